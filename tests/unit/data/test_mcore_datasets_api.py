"""Megatron-Core 0.19.2's dataset surface: the config classes and their fields, the MegatronDataset
base for custom datasets, and the last partial validation sample (add_extra_token_to_sequence and
drop_last_partial_validation_sequence)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from data_test_utils import write_dataset

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron.core.datasets.utils import Split, compile_helpers, get_blend_from_list, normalize
from megatron.core.tokenizer import NullTokenizer

QUIET = {"log": lambda _: None}


def reference_sample_index(sizes, doc_index, S, extra, drop_last):
    """Megatron's C++ ``build_sample_idx`` (helpers.cpp), transcribed as a plain loop."""
    total = int(sum(sizes[d] for d in doc_index))
    n = (total - extra) // S if drop_last else math.ceil((total - extra) / S)
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= n:
        remaining = S + extra
        while remaining != 0:
            length = sizes[doc_index[d]] - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - extra
                remaining = 0
            elif d == len(doc_index) - 1:
                off = sizes[doc_index[d]] - extra
                break
            else:
                d, off = d + 1, 0
        out.append((d, off))
    return np.asarray(out)


def _docs(lengths):
    start = np.cumsum([0] + list(lengths))
    return [np.arange(start[i], start[i + 1], dtype=np.int64) % 997 + 1 for i in range(len(lengths))]


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_exhaustive_validation_split_samples(tmp_path, extra, drop_last):
    """sizes[1] = None asks for one epoch of validation; the partial last sample is kept unless
    drop_last_partial_validation_sequence, and padded (its padded labels carry no loss)."""
    lengths = [7, 1, 12, 5, 3, 9, 4]
    prefix = write_dataset(str(tmp_path / "d"), _docs(lengths))
    S = 8
    cfg = GPTDatasetConfig(
        random_seed=3,
        sequence_length=S,
        blend=([prefix], None),
        split="0,1,0",
        tokenizer=NullTokenizer(1000),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=extra,
        drop_last_partial_validation_sequence=drop_last,
        path_to_cache=str(tmp_path / "c"),
        **QUIET,
    )
    _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [0, None, 0], lambda: True, cfg).build()
    e = int(extra)
    total = sum(lengths)
    n = (total - e) // S if drop_last else math.ceil((total - e) / S)
    assert len(valid) == n
    sizes = np.asarray(lengths)
    np.testing.assert_array_equal(
        valid.sample_index, reference_sample_index(sizes, valid.document_index, S, e, drop_last)
    )
    stream = np.concatenate([_docs(lengths)[d] for d in valid.document_index])
    by_position = {int(j): i for i, j in enumerate(valid.shuffle_index)}
    for j in range(n):
        sample = valid[by_position[j]]
        text = stream[j * S : j * S + S + e]  # the real tokens of sample j; the rest is padding
        ntok, n_labels = min(len(text), S), len(text) - 1
        assert sample["tokens"].shape == sample["labels"].shape == (S,)
        np.testing.assert_array_equal(sample["tokens"][:ntok].numpy(), text[:ntok])
        assert not sample["tokens"][ntok:].any()  # padding is mapped to id 0
        np.testing.assert_array_equal(sample["labels"][:n_labels].numpy(), text[1:])
        mask = sample["loss_mask"].numpy()
        assert mask[:n_labels].all() and not mask[n_labels:].any()


def test_gpt_dataset_config_fields_and_defaults(null_tokenizer):
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=4,
        tokenizer=null_tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    defaults = {
        "multiple_validation_sets": None,
        "full_validation": None,
        "num_dataset_builder_threads": 1,
        "path_to_cache": None,
        "mmap_bin_files": True,
        "mid_level_dataset_surplus": 0.005,
        "allow_ambiguous_pad_tokens": False,
        "fast_cache_load": False,
        "defer_npy_index_mmap": False,
        "create_attention_mask": True,
        "drop_last_partial_validation_sequence": True,
        "add_extra_token_to_sequence": True,
        "object_storage_cache_path": None,
        "data_parallel_size": 1,
        "sequence_parallel_size": 0,
        "hybrid_context_parallel": False,
        "sequences_per_dataset": None,
        "context_parallel_size": None,
        "inter_document_masking": False,
    }
    for name, value in defaults.items():
        assert getattr(cfg, name) == value, name
    assert isinstance(cfg, BlendedMegatronDatasetConfig)
    # mock mode: no blend, an even split, and the token dtype code from the vocabulary size
    assert cfg.mock and cfg.split == "1,1,1" and cfg.split_matrix[0] == (0.0, 1 / 3)
    assert cfg.token_dtype_code == 8
    init_false = {f.name for f in dataclasses.fields(GPTDatasetConfig) if not f.init}
    assert {"split_matrix", "mock", "token_dtype_code"} <= init_false
    # the masking flags default to None as in Megatron-Core; None reads as False here
    assert (
        GPTDatasetConfig(random_seed=1, sequence_length=4, tokenizer=null_tokenizer).reset_position_ids
        is None
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"blend": (["a", "b"], [1.0])}, "blend"),
        ({"blend": (["a"], None)}, "split"),
        ({"blend_per_split": [(["a"], None), None]}, "blend_per_split"),
        ({"blend_per_split": [(["a"], None), None, None], "split": "1,1,1"}, "split"),
        ({"fast_cache_load": True}, "path_to_cache"),
        ({"defer_npy_index_mmap": True}, "path_to_cache"),
        ({"hybrid_context_parallel": True}, "hybrid_context_parallel"),
    ],
)
def test_config_checks_name_the_field(null_tokenizer, kwargs, name):
    with pytest.raises(ValueError, match=name):
        GPTDatasetConfig(random_seed=1, sequence_length=4, tokenizer=null_tokenizer, **kwargs)


def test_accepted_fields_without_effect(null_tokenizer, tmp_path):
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=4,
        tokenizer=null_tokenizer,
        data_parallel_size=4,
        sequence_parallel_size=2,
        context_parallel_size=2,
        full_validation=True,
        multiple_validation_sets=False,
        num_dataset_builder_threads=4,
        fast_cache_load=True,
        defer_npy_index_mmap=True,
        path_to_cache=str(tmp_path),
        blend_per_split=[None, None, None],
        object_storage_cache_path=str(tmp_path),
        sequences_per_dataset={"a": 1},
        **QUIET,
    )
    assert cfg.mock and cfg.blend_per_split is None
    with pytest.raises(ValueError, match="object storage"):
        GPTDataset.build_low_level_dataset("s3://bucket/data", cfg)


def test_inter_document_masking_cu_seqlens():
    """With inter_document_masking a sample carries cu_seqlens (document boundaries padded with S to
    S + 1 entries), max_seqlen and per-document positions, and no attention mask."""
    tok = NullTokenizer(5000)  # eod 4999, and mock documents are shorter than 4096 tokens
    cfg = GPTDatasetConfig(
        random_seed=0, sequence_length=16, tokenizer=tok, inter_document_masking=True, **QUIET
    )
    low = MockGPTDataset.build_low_level_dataset(None, cfg)
    short = np.flatnonzero(low.sequence_lengths < 12)[:30].astype(np.int32)
    ds = MockGPTDataset(low, None, short, 6, Split.train, cfg)
    for i in range(len(ds)):
        s = ds[i]
        assert (
            "attention_mask" not in s
            and s["cu_seqlens"].shape == (17,)
            and s["cu_seqlens"].dtype == torch.int32
        )
        cu = s["cu_seqlens"]
        ends = [0] + [k + 1 for k in range(15) if s["tokens"][k] == 4999] + [16]
        assert cu[: len(ends)].tolist() == ends and (cu[len(ends) :] == 16).all()
        assert int(s["max_seqlen"]) == max(b - a for a, b in zip(ends, ends[1:]))
        for a, b in zip(ends, ends[1:]):
            assert s["position_ids"][a:b].tolist() == list(range(b - a))


class TokenListDataset(MegatronDataset):
    """A user's dataset: each document of the low-level list is one sample."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        n = len(indices) if num_samples is None else num_samples
        self.order = np.resize(indices, n)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        return [torch.full((config.sequence_length,), i) for i in range(int(dataset_path.split("-")[1]))]

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + ["mmap_bin_files"]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx):
        return {"text": self.dataset[int(self.order[idx])]}


def test_custom_megatron_dataset_through_the_builder(null_tokenizer):
    cfg = BlendedMegatronDatasetConfig(
        random_seed=1,
        sequence_length=3,
        blend=(["docs-10", "docs-20"], [1, 3]),
        split="8,2,0",
        tokenizer=null_tokenizer,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        TokenListDataset, [40, None, 0], lambda: True, cfg
    ).build()
    assert test is None
    assert len(train) == 40 and len(valid) == 2 + 4
    first = train.datasets[0]
    assert isinstance(first, TokenListDataset) and first.index_split == Split.train
    assert first.indices.tolist() == list(range(8)) and first.dataset_path == "docs-10"
    ids = first.unique_identifiers
    assert list(ids)[:4] == ["class", "dataset_path", "num_samples", "index_split"]
    assert ids["class"] == "TokenListDataset" and ids["mmap_bin_files"] is True
    assert len(first.unique_description_hash) == 32 and "docs-10" in first.unique_description
    from_second = sum(int(d) for d in train.dataset_index)
    assert from_second == 30  # weights 1:3 of 40 samples
    assert train[0]["text"].shape == (3,)


def test_base_class_contract():
    with pytest.raises(TypeError):
        MegatronDataset(None, None, np.arange(1), None, Split.train, None)  # abstract
    with pytest.raises(NotImplementedError):
        MegatronDataset.numel_low_level_dataset([])
    assert MegatronDataset._key_config_attributes() == [
        "random_seed",
        "sequence_length",
        "split",
        "split_matrix",
        "tokenizer",
    ]
    assert issubclass(GPTDataset, MegatronDataset) and issubclass(MockGPTDataset, GPTDataset)


def test_pad_colliding_with_eod_is_not_masked(null_tokenizer):
    tok = NullTokenizer(10, pad_id=9)  # pad == eod
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=8, tokenizer=tok, **QUIET)
    with pytest.warns(UserWarning, match="pad token"):
        ds = MockGPTDataset(
            MockGPTDataset.build_low_level_dataset(None, cfg),
            None,
            np.arange(3, dtype=np.int32),
            2,
            Split.train,
            cfg,
        )
    assert ds._pad_token_id == -1
    cfg = GPTDatasetConfig(
        random_seed=0, sequence_length=8, tokenizer=tok, allow_ambiguous_pad_tokens=True, **QUIET
    )
    with pytest.warns(UserWarning, match="pad token"):
        ds = MockGPTDataset(
            MockGPTDataset.build_low_level_dataset(None, cfg),
            None,
            np.arange(3, dtype=np.int32),
            2,
            Split.train,
            cfg,
        )
    assert ds._pad_token_id == 9


def test_utils_names():
    compile_helpers()  # nothing to compile: the index helpers are numpy
    assert [s.name for s in Split] == ["train", "valid", "test"] and Split.valid.value == 1
    assert normalize([1, 3]) == [0.25, 0.75]
    assert get_blend_from_list(["2", "a", "6", "b"]) == (["a", "b"], [2.0, 6.0])
    assert get_blend_from_list(None) is None


def test_padding_sample_is_sample_zero_without_loss(null_tokenizer):
    """ds[None] pads a batch: Megatron returns sample 0's tokens with a zero loss mask."""
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=16, tokenizer=null_tokenizer, **QUIET)
    ds = MockGPTDataset(
        MockGPTDataset.build_low_level_dataset(None, cfg),
        None,
        np.arange(3, dtype=np.int32),
        2,
        Split.train,
        cfg,
    )
    pad, first = ds[None], ds[0]
    assert torch.equal(pad["tokens"], first["tokens"]) and torch.equal(pad["labels"], first["labels"])
    assert not pad["loss_mask"].any() and first["loss_mask"].all()


def test_log_single_rank_is_importable_from_datasets_utils(caplog):
    import logging

    from megatron.core.datasets.utils import log_single_rank

    with caplog.at_level(logging.INFO):
        log_single_rank(logging.getLogger("t"), logging.INFO, "built")
    assert "built" in caplog.text
