"""Integrity of ``.bin/.idx`` pairs: the checksum record, index checks and the token-id range.

Megatron's format has no checksum, and its files stay byte for byte Megatron's. What we add lives
beside them, in ``<prefix>/checksum.json`` (the directory training already uses for its index
cache, ``<prefix>/cache/``; a file next to the pair would break Megatron-LM's
``tools/merge_datasets.py``, which takes every file of its input directory for half of a pair)::

    {"format": "megatron-indexed-dataset-checksum", "version": 1, "dtype": "uint16",
     "bin": {"size": B, "sample_sha256": ..., "sample_blocks": 16, "block_bytes": 65536},
     "idx": {"size": I, "sha256": ...}, "token_id_min": m, "token_id_max": M}

``sample_sha256`` hashes 16 blocks of 64 KiB spread evenly over the ``.bin`` (the whole file when
it is smaller than 1 MiB): constant cost at any size; a change between the sampled blocks that
keeps the size escapes it. The ``.idx`` is hashed whole (12 bytes per sequence, a small fraction
of the ``.bin``).

A pair is replaced by renames (``commit``): the record first, then the ``.bin``, then the ``.idx``.
Two renames cannot be one atomic step, but no instant shows a reader that verifies (ours) a wrong
pair that looks right: before the first rename all three files are old, after the last all three
new, and in between the record disagrees with the pair (and, unless the sizes happen to agree, the
``.idx`` with the ``.bin``), which ``verify_dataset`` refuses; a kill in that window (microseconds)
leaves that refused state until the dataset is written again. Megatron-LM's reader checks neither
and could read the new ``.bin`` with the old ``.idx`` in the window. A process that already has the
old pair open keeps reading the old files: a rename never changes an open file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron.core.datasets.errors import DataError
from megatron.core.datasets.utils import build_or_wait_json

RECORD_FORMAT = "megatron-indexed-dataset-checksum"
RECORD_VERSION = 1
RECORD_NAME = "checksum.json"
SAMPLE_BLOCKS = 16
BLOCK_BYTES = 1 << 16
SCAN_CHUNK_BYTES = 64 << 20  # bounds the memory of a token-range scan


def record_path(prefix: str) -> str:
    return os.path.join(prefix, RECORD_NAME)


def tmp_path(path: str) -> str:
    """Where ``path`` is written before its rename: same directory (so the rename is atomic),
    never a name that ends in ``.bin`` or ``.idx`` (so it is never taken for data)."""
    return f"{path}.tmp.{os.getpid()}"


# ---------------------------------------------------------------------------------------- hashes
def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sample_offsets(size: int) -> list[int]:
    """Start of each sampled block: the first and last block and evenly spaced ones between."""
    if size <= SAMPLE_BLOCKS * BLOCK_BYTES:
        return list(range(0, size, BLOCK_BYTES))
    last = size - BLOCK_BYTES
    return [i * last // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def sample_sha256(path: str) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for offset in sample_offsets(size):
            f.seek(offset)
            h.update(f.read(BLOCK_BYTES))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- record
def make_record(bin_path: str, idx_path: str, dtype: Any, token_range: tuple[int, int] | None) -> dict:
    """The record of a finished pair (the files may still carry their temporary names)."""
    lo, hi = token_range if token_range is not None else (None, None)
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "dtype": np.dtype(dtype).name,
        "bin": {
            "size": os.path.getsize(bin_path),
            "sample_sha256": sample_sha256(bin_path),
            "sample_blocks": SAMPLE_BLOCKS,
            "block_bytes": BLOCK_BYTES,
        },
        "idx": {"size": os.path.getsize(idx_path), "sha256": file_sha256(idx_path)},
        "token_id_min": lo,
        "token_id_max": hi,
    }


def read_record(prefix: str) -> dict | None:
    """The pair's checksum record, or None when it has none (data from Megatron-LM or elsewhere).

    Raises:
        DataError: the record is unreadable, or of another format or version.
    """
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"checksum record {path!r} cannot be read ({exc}); delete it to use {prefix}.bin/.idx unverified"
        ) from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise DataError(f"{path!r} is not a checksum record (want format {RECORD_FORMAT!r}); move it away")
    if record.get("version") != RECORD_VERSION:
        raise DataError(
            f"checksum record {path!r} has version {record.get('version')}; only version "
            f"{RECORD_VERSION} is supported"
        )
    return record


def _record_mismatch(prefix: str, record: dict, dtype: Any) -> str | None:
    """What differs between the pair and its record (None: nothing), cheapest check first."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    checks: list[tuple[str, Callable[[], Any], Any]] = [
        (".bin size", lambda: os.path.getsize(bin_path), record["bin"]["size"]),
        (".idx size", lambda: os.path.getsize(idx_path), record["idx"]["size"]),
        ("token dtype", lambda: np.dtype(dtype).name, record["dtype"]),
        (".idx sha256", lambda: file_sha256(idx_path), record["idx"]["sha256"]),
        ("sampled .bin blocks", lambda: sample_sha256(bin_path), record["bin"]["sample_sha256"]),
    ]
    for what, actual, recorded in checks:
        value = actual()
        if value != recorded:
            return (
                f"{what} {value}, recorded {recorded}"
                if "size" in what or what == "token dtype"
                else f"{what} differ from the record"
            )
    return None


def verify_record(prefix: str, record: dict, dtype: Any) -> None:
    """Raises DataError when the pair is not the one its record describes."""
    why = _record_mismatch(prefix, record, dtype)
    if why is not None:
        raise DataError(
            f"{prefix}.bin/.idx do not match their checksum record {record_path(prefix)!r} ({why}): the files "
            "changed after they were written, or a rewrite was interrupted between its renames; write the "
            "dataset again (tools/preprocess_data.py), or delete the record if you replaced the files on purpose"
        )


# ---------------------------------------------------------------------------------------- index
def check_index_contents(index: Any, bin_size: int) -> None:
    """The checks Megatron's writer guarantees for every valid ``.idx`` (so none can fire on one):
    non-negative lengths, pointers that follow them back to back from 0, document boundaries that
    never go back, and a last sequence that ends where the ``.bin`` ends. One vectorised pass.

    Raises:
        DataError: naming the ``.idx`` and the first sequence or document that breaks a rule.
    """
    lengths, pointers, docs = index.sequence_lengths, index.sequence_pointers, index.document_indices
    where = index.path
    if len(lengths) and int(lengths.min()) < 0:
        raise DataError(f"{where!r} is corrupt: sequence {int(np.argmax(lengths < 0))} has a negative length")
    expected = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
    expected *= index.dtype_size
    bad = np.flatnonzero(expected != pointers)
    if len(bad):
        i = int(bad[0])
        raise DataError(
            f"{where!r} is corrupt: sequence {i} starts at byte {int(pointers[i])}, but the lengths "
            f"before it end at byte {int(expected[i])}"
        )
    if len(docs) > 1 and (np.diff(docs) < 0).any():
        j = int(np.argmax(np.diff(docs) < 0))
        raise DataError(
            f"{where!r} is corrupt: document {j} ends before it starts ({int(docs[j])} > {int(docs[j + 1])})"
        )
    end = int(lengths.sum(dtype=np.int64)) * index.dtype_size
    if end != bin_size:
        raise DataError(
            f"{where!r} ends its last sequence at byte {end}, but the .bin holds {bin_size} bytes"
        )


# ---------------------------------------------------------------------------------------- token ids
def scan_token_range(bin_path: str, dtype: Any, nbytes: int | None = None) -> tuple[int, int] | None:
    """(smallest, largest) token id of the first ``nbytes`` of a ``.bin`` (all of it by default),
    None when it holds no token. Reads the memory map in chunks of SCAN_CHUNK_BYTES, so memory
    stays bounded; its cost is reading the file once at memory or disk speed, whichever is lower
    (measured in docs/reliability.md, "Token ids outside the vocabulary")."""
    dtype = np.dtype(dtype)
    size = os.path.getsize(bin_path) if nbytes is None else nbytes
    count = size // dtype.itemsize
    if count == 0:
        return None
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    step = max(SCAN_CHUNK_BYTES // dtype.itemsize, 1)
    lo, hi = None, None
    for start in range(0, count, step):
        chunk = tokens[start : start + step]
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    del tokens
    return lo, hi  # type: ignore[return-value]


def merge_ranges(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a[0], b[0]), max(a[1], b[1])


def array_range(arr: np.ndarray) -> tuple[int, int] | None:
    return None if arr.size == 0 else (int(arr.min()), int(arr.max()))


# ---------------------------------------------------------------------------------------- commit
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(record: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def commit(renames: list[tuple[str, str]]) -> None:
    """Rename each finished temporary file onto its final name, in order (record, .bin, .idx), then
    make the renames durable. The temporary files were fsynced when written, so after a crash a
    name holds either its old or its complete new content."""
    for src, dst in renames:
        os.replace(src, dst)
    for directory in sorted({os.path.dirname(os.path.abspath(dst)) for _, dst in renames}):
        try:
            fsync_path(directory)
        except OSError:  # a directory cannot be opened for fsync on every platform
            pass


# ---------------------------------------------------------------------------------------- checks
def verify_dataset(dataset: Any) -> dict | None:
    """Every check a pair admits beyond the exact sizes ``IndexedDataset`` checks on opening: the
    index contents, and the checksum record when there is one. Valid Megatron-LM data (no record)
    always passes. Returns the record (None without one).

    An end-of-document check (every document ends with the tokenizer's eod) is not made: data
    written without ``--append-eod``, merged from datasets with and without it, or whose text ends
    in the eod string is valid, and a rule that allows all of them catches nothing.

    Raises:
        DataError: naming the file and what is wrong.
    """
    prefix = dataset.path_prefix
    check_index_contents(dataset.index, os.path.getsize(prefix + ".bin"))
    record = read_record(prefix)
    if record is not None:
        verify_record(prefix, record, dataset.index.dtype)
    return record


def _identity(path: str) -> list[int] | None:
    """What changes whenever a file is rewritten or replaced (size, modification time, inode)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def stats_key(prefix: str) -> dict:
    return {
        "class": "IndexedDatasetStats",
        "version": 1,
        "path": os.path.realpath(prefix),
        "bin": _identity(prefix + ".bin"),
        "idx": _identity(prefix + ".idx"),
        "record": _identity(record_path(prefix)),
    }


def compute_stats(dataset: Any, log: Callable[[str], object] = print) -> dict:
    """Verify the pair and find its token-id range: from its record when that holds one, else by
    scanning the ``.bin`` (``scan_token_range``)."""
    t0 = time.perf_counter()
    record = verify_dataset(dataset)
    bin_path = dataset.path_prefix + ".bin"
    if record is not None and record.get("token_id_max") is not None:
        lo, hi, source = int(record["token_id_min"]), int(record["token_id_max"]), "its checksum record"
    else:
        found = scan_token_range(bin_path, dataset.index.dtype)
        lo, hi = found if found is not None else (None, None)
        source = f"a scan of {os.path.getsize(bin_path) / 1e6:.1f} MB"
    log(
        f" > checked {dataset.path_prefix}.bin/.idx ({'checksum verified' if record else 'no checksum record'}): "
        f"token ids {lo} to {hi} from {source} ({time.perf_counter() - t0:.2f} s, cached)"
    )
    return {"token_id_min": lo, "token_id_max": hi, "checksum": record is not None}


def dataset_stats(
    dataset: Any, cache_dir: str, timeout_s: float, log: Callable[[str], object] = print
) -> dict:
    """``compute_stats`` of a pair, done once per version of its files and cached in ``cache_dir``
    as ``{md5}-IndexedDataset-stats.json`` (the md5 of ``stats_key``: path, and size, mtime and
    inode of the ``.bin``, ``.idx`` and record, so that any rewrite computes them again). Later
    runs read one small file. Global rank 0 computes; the other ranks poll for its file, and a
    ``DataError`` it raised is raised on them too, so every rank stops with the same message.

    Returns:
        ``{"token_id_min", "token_id_max", "checksum"}``: the ids (None for a pair without
        tokens) and whether a checksum record was verified.

    Raises:
        DataError: the pair fails ``verify_dataset``, or ``cache_dir`` cannot be written.
    """
    key = stats_key(dataset.path_prefix)
    digest = hashlib.md5(json.dumps(key, sort_keys=True).encode()).hexdigest()
    path = os.path.join(cache_dir, f"{digest}-IndexedDataset-stats.json")
    return build_or_wait_json(path, key, lambda: compute_stats(dataset, log), timeout_s, log)
