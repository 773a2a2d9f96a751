"""Fixtures of the data tests."""

from __future__ import annotations

import numpy as np
import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.tokenizer import NullTokenizer


@pytest.fixture
def null_tokenizer() -> NullTokenizer:
    return NullTokenizer(1000)


@pytest.fixture
def small_dataset(tmp_path) -> tuple[str, list[np.ndarray]]:
    docs = random_docs(0, 300)
    return write_dataset(str(tmp_path / "small_text_document"), docs), docs
