"""Splits that hold no sample: not built, named in one line, refused only for training (issue 22)."""

from __future__ import annotations

import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split
from megatron.core.tokenizer import NullTokenizer
from megatron.training.datasets.provider import report_empty_splits


def builder(sizes, seq=16, on_rank=True, **blends):
    cfg = GPTDatasetConfig(
        random_seed=1, sequence_length=seq, tokenizer=NullTokenizer(1000), log=lambda _: None, **blends
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: on_rank, cfg)


@pytest.fixture
def corpus_399(tmp_path):
    """As many documents as the bundled corpus: --split 949,50,1 leaves its test split none."""
    return write_dataset(str(tmp_path / "c399"), random_docs(0, 399, max_len=60))


def test_rounded_away_split_is_not_built_and_named(corpus_399):
    b = builder([40, 8, 8], blend=([corpus_399], None), split="949,50,1")
    assert b.empty_splits() == {Split.test: "--split 949,50,1 gives it 0 of 399 documents"}
    train, valid, test = b.build()
    assert len(train) >= 40 and len(valid) >= 8 and test is None
    logs: list[str] = []
    report_empty_splits(b.empty_splits(), logs.append)
    assert logs == [
        " > test split is empty (--split 949,50,1 gives it 0 of 399 documents): no test evaluation"
    ]


def test_every_rank_reaches_the_same_verdict(corpus_399):
    """A rank that builds no dataset still names the empty split and refuses an empty train split."""
    assert builder(
        [40, 8, 8], on_rank=False, blend=([corpus_399], None), split="949,50,1"
    ).empty_splits() == {Split.test: "--split 949,50,1 gives it 0 of 399 documents"}
    for on_rank in (True, False):
        with pytest.raises(
            ValueError,
            match=r"^train split is empty \(--split 0,50,50 gives it 0 of 399 "
            r"documents\); give it a share, e.g. --split 969,30,1$",
        ):
            builder([40, 8, 8], on_rank=on_rank, blend=([corpus_399], None), split="0,50,50").build()


def test_zero_share_and_too_few_tokens(tmp_path, corpus_399):
    b = builder([40, 0, 8], blend=([corpus_399], None), split="99,0,1")
    assert set(b.empty_splits()) == {Split.valid}  # 4 documents still hold a sample
    tiny = write_dataset(str(tmp_path / "tiny"), [d[:3] for d in random_docs(1, 100)])  # 100 x 3 tokens
    b = builder([40, 8, 8], blend=([tiny], None), split="98,1,1")
    assert b.empty_splits() == {
        Split.valid: "--split 98,1,1 gives it 1 of 100 documents, 3 tokens, fewer than one sample of 17",
        Split.test: "--split 98,1,1 gives it 1 of 100 documents, 3 tokens, fewer than one sample of 17",
    }
    assert b.build()[1:] == [None, None]
    with pytest.raises(
        ValueError,
        match=r"^train split is empty \(--split 1,1,1 gives it 33 of 100 documents, 99 "
        r"tokens, fewer than one sample of 401\)",
    ):
        builder([40, 8, 8], seq=400, blend=([tiny], None), split="1,1,1").build()


def test_train_split_of_zero_samples_is_not_refused(corpus_399):
    b = builder([0, 8, 8], blend=([corpus_399], None), split="0,50,50")
    assert b.build()[0] is None
    logs: list[str] = []
    report_empty_splits(b.empty_splits(), logs.append)
    assert logs == [" > train split is empty (--split 0,50,50 gives it 0 of 399 documents): no training"]


def test_blends(tmp_path):
    big = write_dataset(str(tmp_path / "big"), random_docs(3, 2000, max_len=60))  # test split: 2 documents
    small = write_dataset(str(tmp_path / "small"), random_docs(2, 10, max_len=60))  # test split: 0 documents
    # Weighted: the test split cannot be drawn in the asked proportions.
    b = builder([40, 8, 8], blend=([big, small], [0.5, 0.5]), split="949,50,1")
    assert b.empty_splits() == {Split.test: f"--split 949,50,1 gives it 0 of 10 documents of {small}"}
    train, valid, test = b.build()
    assert len(train) >= 40 and len(valid) >= 8 and test is None
    # Unweighted: the datasets that hold samples are blended; only all-empty counts.
    b = builder([40, 8, 8], blend=([big, small], None), split="949,50,1")
    assert b.empty_splits() == {}
    test = b.build()[2]
    assert len(test) == len(test.datasets[0]) > 0 and len(test.datasets[1]) == 0
    assert builder([40, 8, 8], blend=([small, small], None), split="949,50,1").empty_splits() == {
        Split.test: f"--split 949,50,1 gives it 0 of 10 documents of {small}; 0 of 10 documents of {small}"
    }


def test_per_split_paths(tmp_path, corpus_399):
    tiny = write_dataset(str(tmp_path / "tiny"), [[1, 2, 3]])
    b = builder([40, 8, 8], blend_per_split=[([corpus_399], None), None, ([tiny], None)])
    assert b.empty_splits() == {
        Split.test: f"--test-data-path gives it 1 of 1 documents of {tiny}, 3 tokens, fewer than one sample of 17"
    }
    assert b.build()[1:] == [None, None]
    with pytest.raises(
        ValueError, match=r"^train split is empty \(--train-data-path .*; give --train-data-path"
    ):
        builder([40, 8, 8], blend_per_split=[([tiny], None), None, None]).build()


def test_mock_data_with_a_zero_share():
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=16, tokenizer=NullTokenizer(100), split="100,0,0")
    b = BlendedMegatronDatasetBuilder(MockGPTDataset, [10, 8, 8], lambda: True, cfg)
    assert b.empty_splits() == {
        Split.valid: "--split 100,0,0 gives it 0 of 100000 documents",
        Split.test: "--split 100,0,0 gives it 0 of 100000 documents",
    }
    assert len(b.build()[0]) >= 10
