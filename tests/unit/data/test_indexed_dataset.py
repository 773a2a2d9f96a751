"""The .bin/.idx format: round trip, byte layout field by field, corruption errors."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


def test_round_trip_and_partial_reads(small_dataset):
    prefix, docs = small_dataset
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert ds.index.dtype == np.uint16
    for i in (0, 17, len(docs) - 1):
        assert np.array_equal(ds[i], docs[i])
        n = len(docs[i])
        assert np.array_equal(ds.get(i, n // 2), docs[i][n // 2 :])
        assert np.array_equal(ds.get(i, 0, min(3, n)), docs[i][: min(3, n)])
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)
    # pickling reopens by path (data-loader workers) instead of copying the map
    clone = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(clone[5], docs[5])
    plain = IndexedDataset(prefix, mmap=False)
    assert np.array_equal(plain[9], docs[9])


def test_byte_layout_matches_the_spec(tmp_path):
    prefix = str(tmp_path / "layout")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_document([5, 6, 7], [2, 1])  # one document of two sentences
    b.add_document([], [])  # an empty document: a boundary with no sequence
    b.add_item(np.array([9, 10, 11, 12]))
    b.end_document()
    b.finalize(prefix + ".idx")
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # uint16
    n, d = struct.unpack("<QQ", raw[18:34])
    assert (n, d) == (3, 4)
    assert struct.unpack("<3i", raw[34:46]) == (2, 1, 4)
    assert struct.unpack("<3q", raw[46:70]) == (0, 4, 6)  # byte pointers
    assert struct.unpack("<4q", raw[70:102]) == (0, 2, 2, 3)
    assert len(raw) == 102
    assert open(prefix + ".bin", "rb").read() == np.array([5, 6, 7, 9, 10, 11, 12], "<u2").tobytes()


def test_dtype_choice():
    assert DType.optimal_dtype(50257) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    assert [DType.code_from_dtype(t) for t in (np.uint8, np.int32, np.uint16)] == [1, 4, 8]


def test_merge_with_add_index(tmp_path):
    a_docs, b_docs = random_docs(1, 20), random_docs(2, 30)
    a = write_dataset(str(tmp_path / "a"), a_docs)
    b = write_dataset(str(tmp_path / "b"), b_docs)
    out = str(tmp_path / "merged")
    m = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    m.add_index(a)
    m.add_index(b)
    m.finalize(out + ".idx")
    ds = IndexedDataset(out)
    assert len(ds) == 50
    assert all(np.array_equal(ds[i], x) for i, x in enumerate(a_docs + b_docs))
    assert ds.document_indices.tolist() == list(range(51))


def test_bulk_add_documents_equals_item_by_item(tmp_path):
    docs = random_docs(3, 40)
    one = write_dataset(str(tmp_path / "one"), docs)
    bulk = str(tmp_path / "bulk")
    b = IndexedDatasetBuilder(bulk + ".bin", dtype=np.uint16)
    b.add_documents(np.concatenate(docs), [len(x) for x in docs])
    b.finalize(bulk + ".idx")
    for ext in (".bin", ".idx"):
        assert open(one + ext, "rb").read() == open(bulk + ext, "rb").read()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda idx, bin_: idx.write_bytes(b"XXXXXXXXX" + idx.read_bytes()[9:]), "bad magic"),
        (
            lambda idx, bin_: idx.write_bytes(
                idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]
            ),
            "version 2",
        ),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-9]), "truncated"),
        (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "truncated"),
        (lambda idx, bin_: bin_.unlink(), "does not exist"),
    ],
)
def test_corruption_is_reported_with_the_file(small_dataset, damage, message):
    from pathlib import Path

    prefix, _ = small_dataset
    damage(Path(prefix + ".idx"), Path(prefix + ".bin"))
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert "small_text_document" in str(info.value)
