"""GPTDataset on real indexed files: coverage, sample shape, determinism, caching, blending."""

from __future__ import annotations

import os

import numpy as np
import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import convert_split_vector_to_split_matrix, parse_and_normalize_split
from megatron.core.tokenizer import NullTokenizer


def build(prefixes, sizes, seed=1, seq=32, split="1,0,0", cache=None, weights=None, logs=None):
    cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=cache,
        tokenizer=NullTokenizer(1000),
        log=(logs.append if logs is not None else lambda _: None),
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


def reference_sample_index(sizes, doc_index, S, n):
    """Megatron's C++ build_sample_idx, transcribed as a plain loop."""
    out = [(0, 0)]
    d, off = 0, 0
    for _ in range(n):
        remaining = S + 1
        while remaining != 0:
            length = sizes[doc_index[d]] - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                d, off = d + 1, 0
        out.append((d, off))
    return np.array(out)


def test_split_parsing():
    assert np.allclose(parse_and_normalize_split("969, 30, 1"), [0.969, 0.03, 0.001])
    assert np.allclose(parse_and_normalize_split("98/2"), [0.98, 0.02, 0.0])
    m = convert_split_vector_to_split_matrix(parse_and_normalize_split("1,1,0"))
    assert m[0] == (0.0, 0.5) and m[1] == (0.5, 1.0) and m[2] is None


def test_sample_index_matches_the_reference_loop():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, size=200).astype(np.int32)
    sizes[::7] = 1
    doc_index = rng.permutation(200).astype(np.int32)
    for S in (1, 7, 64):
        n = (int(sizes.sum()) - 1) // S
        ours = helpers.build_sample_index(sizes, doc_index, S, n)
        assert np.array_equal(ours, reference_sample_index(sizes, doc_index, S, n))


def test_every_token_once_per_epoch(small_dataset):
    prefix, docs = small_dataset
    (ds, _, _) = build([prefix], [None, None, None])
    S = 32
    assert ds.num_epochs == 1
    assert sorted(ds.document_index.tolist()) == list(range(len(docs)))
    stream = np.concatenate([docs[i] for i in ds.document_index])
    assert len(ds) == (len(stream) - 1) // S
    inverse = np.argsort(ds.shuffle_index)
    for j in range(len(ds)):
        s = ds[int(inverse[j])]
        assert np.array_equal(s["tokens"].numpy(), stream[j * S : (j + 1) * S])
        assert np.array_equal(s["labels"].numpy(), stream[j * S + 1 : (j + 1) * S + 1])


def test_multiple_epochs_and_separate_last_epoch(small_dataset):
    prefix, docs = small_dataset
    tokens = sum(len(d) for d in docs)
    per_epoch = (tokens - 1) // 32
    (ds, _, _) = build([prefix], [int(per_epoch * 2.3), None, None])
    assert ds.num_epochs == 3 and len(ds) >= int(per_epoch * 2.3)
    counts = np.bincount(ds.document_index, minlength=len(docs))
    assert (counts == 3).all()
    # the partial last epoch (0.3 < 0.8) is shuffled on its own: the first two epochs come first
    assert sorted(ds.document_index[: 2 * len(docs)].tolist()) == sorted(list(range(len(docs))) * 2)


def test_splits_are_disjoint_document_ranges(small_dataset):
    prefix, docs = small_dataset
    tr, va, te = build([prefix], [10, 2, 0], split="8,1,1")
    assert tr.indices[0] == 0 and tr.indices[-1] + 1 == va.indices[0] and va.indices[-1] + 1 == te.indices[0]
    assert te.indices[-1] == len(docs) - 1


def test_deterministic_and_seed_dependent(small_dataset):
    prefix, _ = small_dataset
    a, b, c = (
        build([prefix], [50, 0, 0])[0],
        build([prefix], [50, 0, 0])[0],
        build([prefix], [50, 0, 0], seed=2)[0],
    )
    assert np.array_equal(a.shuffle_index, b.shuffle_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_reused_and_rebuilt_on_change(small_dataset, tmp_path):
    prefix, _ = small_dataset
    cache = str(tmp_path / "cache")
    logs = []
    first = build([prefix], [50, None, None], cache=cache, logs=logs)[0]
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all("GPTDataset-train" in f for f in files)
    logs.clear()
    again = build([prefix], [50, None, None], cache=cache, logs=logs)[0]
    assert any("from cache" in line for line in logs) and not any(" > built " in line for line in logs)
    assert np.array_equal(first.shuffle_index, again.shuffle_index)
    build([prefix], [50, None, None], cache=cache, seq=16)
    build([prefix], [50, None, None], cache=cache, seed=9)
    assert len(os.listdir(cache)) == 12
    # default location: <prefix>/cache/GPTDataset_indices
    build([prefix], [50, None, None])
    assert len(os.listdir(os.path.join(prefix, "cache", "GPTDataset_indices"))) == 4


def test_stale_cache_is_detected(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 100))
    cache = str(tmp_path / "cache")
    build([prefix], [20, None, None], cache=cache)
    write_dataset(prefix, random_docs(1, 60))  # regenerated data under the same path
    with pytest.raises(ValueError, match="does not match the data files"):
        build([prefix], [20, None, None], cache=cache)


def test_blend_proportions_within_one_percent(tmp_path):
    prefixes = [write_dataset(str(tmp_path / f"p{i}"), random_docs(10 + i, 150 + 100 * i)) for i in range(3)]
    weights = [0.2, 0.5, 0.3]
    logs = []
    (blend, _, _) = build(prefixes, [10_000, None, None], weights=weights, seq=8, logs=logs)
    assert isinstance(blend, BlendedDataset) and len(blend) == 10_000
    realised = np.bincount(blend.dataset_index, minlength=3) / len(blend)
    assert np.abs(realised - weights).max() < 0.01
    assert any("requested weight 0.5000" in line for line in logs)
    sample = blend[123]
    assert int(sample["dataset_id"]) == int(blend.dataset_index[123]) and sample["tokens"].shape == (8,)


def test_blend_without_weights_uses_sizes(tmp_path):
    prefixes = [write_dataset(str(tmp_path / f"q{i}"), random_docs(20 + i, 100)) for i in range(2)]
    (blend, _, _) = build(prefixes, [None, None, None])
    assert len(blend) == sum(len(d) for d in blend.datasets)
    for d, child in enumerate(blend.datasets):
        assert sorted(blend.dataset_sample_index[blend.dataset_index == d].tolist()) == list(
            range(len(child))
        )


def test_too_small_split_names_the_flag(tmp_path):
    prefix = write_dataset(str(tmp_path / "tiny"), random_docs(0, 3, max_len=4))
    with pytest.raises(ValueError, match="--split"):
        build([prefix], [5, 5, 0], split="1,1,0", seq=64)
