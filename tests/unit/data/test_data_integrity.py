"""Issue 23: a pair is replaced only whole, its checksum record, the exact size and index checks,
the token-id range (scanned once, cached), the vocabulary bound and the blend's alternation."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import numpy as np
import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets import integrity
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, write_index
from megatron.core.datasets.utils import build_or_wait_json, get_blend_from_list
from megatron.core.tokenizer import NullTokenizer
from megatron.training.datasets.provider import check_data


def md5s(prefix: str) -> tuple[str, ...]:
    return tuple(hashlib.md5(open(prefix + s, "rb").read()).hexdigest() for s in (".bin", ".idx"))


def megatron_pair(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> str:
    """A pair as Megatron-LM writes it: the two files and nothing beside them."""
    np.concatenate(docs).astype(dtype).tofile(prefix + ".bin")
    write_index(prefix + ".idx", dtype, np.array([len(d) for d in docs]), np.arange(len(docs) + 1))
    return prefix


def config(prefixes, cache=None, vocab=1000) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        blend=(prefixes, None),
        split="1,0,0",
        path_to_cache=cache,
        tokenizer=NullTokenizer(vocab),
        log=lambda _: None,
    )


# ------------------------------------------------------------------------------ replacing a pair
def test_builder_replaces_a_pair_only_when_finalized(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 50))
    old = md5s(prefix)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in random_docs(1, 80):
        b.add_item(d)
        b.end_document()
    b.prepare(prefix + ".idx")  # everything written, nothing renamed yet
    assert md5s(prefix) == old and len(IndexedDataset(prefix)) == 50
    b.abort()
    assert md5s(prefix) == old and sorted(os.listdir(tmp_path)) == ["d", "d.bin", "d.idx"]
    integrity.verify_dataset(IndexedDataset(prefix))  # the old record still describes the old pair
    write_dataset(prefix, random_docs(1, 80))
    assert len(IndexedDataset(prefix)) == 80 and sorted(os.listdir(tmp_path)) == ["d", "d.bin", "d.idx"]
    integrity.verify_dataset(IndexedDataset(prefix))


@pytest.mark.parametrize("old_has_record", [True, False])
def test_every_instant_between_the_renames_is_refused(tmp_path, old_has_record):
    """The record, the .bin and the .idx are renamed one after the other: a reader that verifies sees
    the old pair, a refused one, or the new pair, never a wrong pair that passes."""
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 50))
    if not old_has_record:
        os.remove(os.path.join(prefix, "checksum.json"))  # a pair Megatron-LM wrote
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in random_docs(1, 60):
        b.add_document(d, [len(d)])
    b.prepare(prefix + ".idx")
    renames = list(b._renames)
    assert [os.path.basename(dst) for _, dst in renames] == ["checksum.json", "d.bin", "d.idx"]
    for src, dst in renames[:-1]:
        os.replace(src, dst)  # killed right after this rename
        with pytest.raises(ValueError):
            integrity.verify_dataset(IndexedDataset(prefix))
    os.replace(*renames[-1])
    assert len(IndexedDataset(prefix)) == 60
    integrity.verify_dataset(IndexedDataset(prefix))


def test_record_is_written_beside_the_pair_and_names_the_token_range(tmp_path):
    docs = [np.array([5, 7, 3]), np.array([900, 2])]
    prefix = write_dataset(str(tmp_path / "d"), docs)
    record = json.load(open(os.path.join(prefix, "checksum.json")))
    assert record["format"] == "megatron-indexed-dataset-checksum" and record["version"] == 1
    assert record["dtype"] == "uint16" and (record["token_id_min"], record["token_id_max"]) == (2, 900)
    assert record["bin"]["size"] == 10 and record["idx"]["size"] == os.path.getsize(prefix + ".idx")
    # merging carries the range over without a record of its inputs
    merged = str(tmp_path / "m")
    b = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    b.add_index(megatron_pair(str(tmp_path / "meg"), [np.array([1, 4000])]))
    b.add_index(prefix)
    b.finalize(merged + ".idx")
    assert json.load(open(os.path.join(merged, "checksum.json")))["token_id_max"] == 4000
    integrity.verify_dataset(IndexedDataset(merged))


# ------------------------------------------------------------------------------ mismatched files
def test_bin_larger_than_its_index_is_refused(tmp_path):
    small = megatron_pair(str(tmp_path / "small"), random_docs(0, 10))
    big = megatron_pair(str(tmp_path / "big"), random_docs(1, 40))
    os.replace(small + ".idx", big + ".idx")
    with pytest.raises(
        ValueError,
        match=r"holds \d+ bytes, but its index .*big.idx' ends its last document at "
        r"byte \d+: they are not one dataset",
    ):
        IndexedDataset(big)


def test_index_contents_are_checked(tmp_path):
    prefix = str(tmp_path / "d")
    np.arange(5, dtype=np.uint16).tofile(prefix + ".bin")  # 10 bytes
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 4)
    lengths, docs = struct.pack("<3i", 2, 1, 2), struct.pack("<4q", 0, 1, 2, 3)

    def idx(pointers=(0, 4, 6), documents=docs, tail=b""):
        with open(prefix + ".idx", "wb") as f:
            f.write(header + lengths + struct.pack("<3q", *pointers) + documents + tail)

    idx()
    integrity.verify_dataset(IndexedDataset(prefix))
    idx(pointers=(0, 2, 6))  # sequence 1 overlaps sequence 0; the last one still ends at byte 10
    ds = IndexedDataset(prefix)  # the sizes agree: only the contents tell
    with pytest.raises(
        ValueError,
        match=r"d.idx' is corrupt: sequence 1 starts at byte 2, but the lengths before "
        r"it end at byte 4$",
    ):
        integrity.verify_dataset(ds)
    idx(documents=struct.pack("<4q", 0, 2, 1, 3))
    with pytest.raises(ValueError, match=r"d.idx' is corrupt: document 1 ends before it starts \(2 > 1\)$"):
        integrity.verify_dataset(IndexedDataset(prefix))
    idx(tail=b"\x00" * 7)
    with pytest.raises(
        ValueError,
        match=r"d.idx' is corrupt: 109 bytes, its header describes 102 \(3 sequences, "
        r"3 documents\)$",
    ):
        IndexedDataset(prefix)
    idx(tail=b"\x00" * 3)  # sequence modes of a multimodal file: read as text data, as Megatron does
    integrity.verify_dataset(IndexedDataset(prefix))


def test_same_size_files_of_another_dataset_fail_the_record(tmp_path):
    docs = random_docs(0, 30)
    a = write_dataset(str(tmp_path / "a"), docs)
    b = write_dataset(str(tmp_path / "b"), [(d + 1) % 999 for d in docs])  # same lengths, other tokens
    os.replace(b + ".bin", a + ".bin")
    with pytest.raises(
        ValueError,
        match=r"a.bin/.idx do not match their checksum record .*a/checksum.json' "
        r"\(sampled .bin blocks differ from the record\)",
    ):
        integrity.verify_dataset(IndexedDataset(a))
    a = write_dataset(str(tmp_path / "a2"), docs)
    c = write_dataset(str(tmp_path / "c"), docs[::-1])  # the same lengths in another order
    os.replace(c + ".idx", a + ".idx")
    with pytest.raises(ValueError, match=r"\(.idx sha256 differ from the record\)"):
        integrity.verify_dataset(IndexedDataset(a))
    os.remove(os.path.join(a, "checksum.json"))  # without its record, a pair of equal sizes passes
    integrity.verify_dataset(IndexedDataset(a))


def test_a_foreign_record_is_refused(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 10))
    path = os.path.join(prefix, "checksum.json")
    record = json.load(open(path))
    json.dump({**record, "version": 2}, open(path, "w"))
    with pytest.raises(ValueError, match="has version 2; only version 1"):
        integrity.verify_dataset(IndexedDataset(prefix))
    open(path, "w").write("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        integrity.verify_dataset(IndexedDataset(prefix))


# ------------------------------------------------------------------------------ token ids
def test_token_range_is_scanned_once_and_cached(tmp_path, monkeypatch):
    docs = random_docs(0, 40)
    docs[3][0] = 0  # ids 0 to 999 (the last token of every document is 999)
    prefix = megatron_pair(str(tmp_path / "meg"), docs)  # no record: the .bin is scanned
    cache = str(tmp_path / "cache")
    logs: list[str] = []
    stats = integrity.dataset_stats(IndexedDataset(prefix), cache, 10, logs.append)
    assert (stats["token_id_min"], stats["token_id_max"], stats["checksum"]) == (0, 999, False)
    assert len(logs) == 1 and "no checksum record" in logs[0] and "a scan of" in logs[0]
    assert [f for f in os.listdir(cache) if f.endswith("-IndexedDataset-stats.json")]

    def no_scan(*_):
        raise AssertionError("scanned again")

    monkeypatch.setattr(integrity, "scan_token_range", no_scan)
    assert integrity.dataset_stats(IndexedDataset(prefix), cache, 10, logs.append) == stats and len(logs) == 1
    time.sleep(0.01)
    docs[0][0] = 0
    megatron_pair(prefix, docs)  # rewritten under the same name: computed again
    with pytest.raises(AssertionError, match="scanned again"):
        integrity.dataset_stats(IndexedDataset(prefix), cache, 10, logs.append)
    # with a record the ids come from it, and nothing is scanned
    written = write_dataset(str(tmp_path / "ours"), docs)
    stats = integrity.dataset_stats(IndexedDataset(written), cache, 10, logs.append)
    assert stats["checksum"] and stats["token_id_max"] == 999


def test_scan_in_chunks_matches_numpy(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "SCAN_CHUNK_BYTES", 64)
    arr = np.random.default_rng(0).integers(-5000, 70000, size=1001).astype(np.int32)
    arr.tofile(tmp_path / "x.bin")
    assert integrity.scan_token_range(str(tmp_path / "x.bin"), np.int32) == (int(arr.min()), int(arr.max()))
    assert integrity.scan_token_range(str(tmp_path / "x.bin"), np.int32, 0) is None


@pytest.mark.parametrize(
    "vocab, padded, message",
    [
        (1000, 1024, None),
        (
            990,
            1024,
            r"^--data-path: '.*d.bin' holds token id 999, outside the vocabulary of NullTokenizer \(--vocab-size "
            r"990: ids 0 to 989\); it would train padding row 999 of the model's embedding of 1024 rows\. ",
        ),
        (900, 960, r"holds token id 999, .* it would index past the model's embedding of 960 rows"),
        (
            1000,
            512,
            r"holds token id 999, beyond the model's embedding of 512 rows \(--padded-vocab-size 512\)",
        ),
    ],
)
def test_vocabulary_bound(tmp_path, vocab, padded, message):
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 40))  # ids 0 to 999
    cfg = config([prefix], vocab=vocab)
    if message is None:
        check_data(cfg, padded)
    else:
        with pytest.raises(ValueError, match=message):
            check_data(cfg, padded)


def test_negative_ids_and_per_split_flags(tmp_path):
    good = write_dataset(str(tmp_path / "good"), random_docs(0, 20))
    bad = megatron_pair(str(tmp_path / "bad"), [np.array([3, -2, 5])], dtype=np.int32)
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=2,
        blend_per_split=[([good], None), ([bad], None), None],
        tokenizer=NullTokenizer(1000),
        log=lambda _: None,
    )
    with pytest.raises(ValueError, match=r"^--valid-data-path: '.*bad.bin' holds token id -2, a negative id"):
        check_data(cfg, 1024)


def test_a_mismatched_pair_is_named_with_its_flag(tmp_path):
    a = write_dataset(str(tmp_path / "a"), random_docs(0, 30))
    b = write_dataset(str(tmp_path / "b"), [(d + 1) % 999 for d in random_docs(0, 30)])
    os.replace(b + ".bin", a + ".bin")
    with pytest.raises(ValueError, match=r"^--data-path: .*a.bin/.idx do not match their checksum record"):
        check_data(config([a], cache=str(tmp_path / "cache")), 1024)


# ------------------------------------------------------------------------------ ranks
def test_other_ranks_wait_for_rank_0_and_share_its_error(tmp_path, monkeypatch):
    from megatron.core.datasets import utils

    path, key = str(tmp_path / "c" / "x-stats.json"), {"k": 1}
    monkeypatch.setattr(utils, "global_rank", lambda: 1)
    writer = threading.Timer(
        0.3,
        lambda: (
            os.makedirs(tmp_path / "c"),
            open(path, "w").write(json.dumps({"key": key, "result": {"v": 3}})),
        ),
    )
    writer.start()
    assert build_or_wait_json(path, key, lambda: {"v": 0}, 10, poll_s=0.05) == {"v": 3}
    other = str(tmp_path / "c" / "y-stats.json")
    open(other + ".error", "w").write(json.dumps({"type": "ValueError", "message": "--data-path: bad pair"}))
    with pytest.raises(ValueError, match=r"^--data-path: bad pair$"):
        build_or_wait_json(other, key, lambda: {"v": 0}, 10, poll_s=0.05)
    monkeypatch.setattr(utils, "global_rank", lambda: 0)  # rank 0 clears an earlier run's failure

    def fail():
        raise ValueError("again")

    with pytest.raises(ValueError, match="again"):
        build_or_wait_json(other, key, fail, 10)
    assert json.load(open(other + ".error")) == {"type": "ValueError", "message": "again"}
    assert build_or_wait_json(other, key, lambda: {"v": 1}, 10) == {"v": 1} and not os.path.exists(
        other + ".error"
    )


# ------------------------------------------------------------------------------ blends
def test_weights_and_prefixes_must_alternate(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"^--data-path '0.5 A 0.5': weights and prefixes must alternate \(WEIGHT "
        r"PREFIX \[WEIGHT PREFIX \.\.\.\], e\.g\. 0\.3 A 0\.7 B\) or be prefixes "
        r"only; 3 entries cannot pair up$",
    ):
        get_blend_from_list(["0.5", "A", "0.5"])
    with pytest.raises(
        ValueError, match=r"^--train-data-path 'A 0.5 B 0.5': .*; 'A' stands where a weight should be"
    ):
        get_blend_from_list(["A 0.5 B 0.5"], "--train-data-path")
    assert get_blend_from_list(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert get_blend_from_list(["A", "B", "C"]) == (["A", "B", "C"], None)
    monkeypatch.chdir(tmp_path)
    write_dataset("7", random_docs(0, 5))  # a dataset named like a number is a prefix
    assert get_blend_from_list(["7", "A", "B"]) == (["7", "A", "B"], None)
