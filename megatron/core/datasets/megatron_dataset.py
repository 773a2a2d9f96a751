"""MegatronDataset: the base of every dataset BlendedMegatronDatasetBuilder builds.

A subclass (GPTDataset, or a user's own) supplies two static methods the builder calls before any
dataset exists, ``build_low_level_dataset(path, config)`` and ``numel_low_level_dataset(low)``
(the number of units the split proportions divide), plus ``__len__`` and ``__getitem__``. The
builder then constructs it as ``cls(low, path, indices, num_samples, split, config)``.
"""

from __future__ import annotations

import hashlib
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Union

import numpy as np
from torch.utils.data import Dataset

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, dumps_description

LowLevelDataset = Union[IndexedDataset, Iterable]

_PAD_TOKEN_ID = -1
"""The pad id used when the tokenizer has none (or an ambiguous one): no real token equals it."""


class MegatronDataset(ABC, Dataset):
    """A split of a low-level dataset, identified by a description hashed into cache keys.

    Args:
        dataset: the low-level dataset (``build_low_level_dataset``'s result).
        dataset_path: its path, for bookkeeping (None for mock data).
        indices: the units (documents) of ``dataset`` this split exposes.
        num_samples: samples wanted (None: one epoch).
        index_split: which split this is.
        config: the builder's config.

    Sets ``unique_identifiers`` (class, dataset_path, num_samples, index_split, then each
    ``_key_config_attributes()`` of ``config``), its JSON ``unique_description`` and that string's
    MD5 ``unique_description_hash``, and ``_pad_token_id`` (the tokenizer's pad id; -1 when it has
    none or when it equals eod/eos and ``config.allow_ambiguous_pad_tokens`` is False, with a
    warning in both collision cases).
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset: Any = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config: Any = config
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = dataset_path
        ids["num_samples"] = num_samples
        ids["index_split"] = index_split.name
        for attr in self._key_config_attributes():
            ids[attr] = getattr(config, attr)
        self.unique_identifiers = ids
        self.unique_description = dumps_description(ids)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self._pad_token_id = _resolve_pad_id(
            getattr(config, "tokenizer", None), bool(getattr(config, "allow_ambiguous_pad_tokens", False))
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """Units of ``low_level_dataset`` that the split proportions divide (documents for GPT)."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: Any, config: Any) -> Any:
        """The low-level dataset at ``dataset_path``, shared by every split built from it."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """Config fields that, with the path, sample count and split, identify this dataset."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """Samples in this dataset."""

    @abstractmethod
    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Sample ``idx``: a dict of tensors or arrays."""


def _resolve_pad_id(tokenizer: Any, allow_ambiguous: bool) -> int:
    try:
        pad = int(tokenizer.pad)
    except Exception:
        return _PAD_TOKEN_ID
    special: list[int] = []
    try:
        special = [int(v) for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except Exception:
        special = []
    if not special:
        for name in ("eos", "eod"):
            try:
                special.append(int(getattr(tokenizer, name)))
            except Exception:
                pass
    if pad < 0 or pad not in special:
        return pad
    if allow_ambiguous:
        warnings.warn(
            f"the tokenizer's pad token id {pad} equals another special token id; with "
            "allow_ambiguous_pad_tokens=True those tokens are masked out of the loss, which can "
            "destabilise training",
            stacklevel=3,
        )
        return pad
    warnings.warn(
        f"the tokenizer's pad token id {pad} equals another special token id; it is not treated as "
        "padding (no token of the data is masked for it). Give a tokenizer with a distinct pad id, "
        "or allow_ambiguous_pad_tokens=True",
        stacklevel=3,
    )
    return _PAD_TOKEN_ID
