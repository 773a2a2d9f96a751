"""Megatron's ``.bin/.idx`` indexed dataset: byte-compatible reader and builder.

``.idx`` (little-endian, packed)::

    0   9 bytes   magic b"MMIDIDX\\x00\\x00"
    9   uint64    version (1)
    17  uint8     dtype code of the tokens in .bin (see DType)
    18  uint64    N, number of sequences
    26  uint64    D, length of the document-index array (#documents + 1)
    34  int32[N]  sequence lengths in tokens
        int64[N]  sequence pointers: byte offsets into .bin
        int64[D]  document indices: sequence boundaries, 0 ... N
        int8[N]   sequence modes (multimodal files only)

``.bin`` is the raw concatenation of every sequence's tokens in that dtype, no header.
Reads are memory-mapped views (no copy). Every inconsistency between the two files raises a
``DataError`` naming the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from megatron.core.config_utils import ConfigError
from megatron.core.datasets import integrity
from megatron.core.datasets.errors import DataError
from megatron.core.datasets.integrity import tmp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype 1 + N 8 + D 8


class DType(IntEnum):
    """Token dtype codes of the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: Any) -> int:
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ConfigError(
                f"dtype {name} cannot be stored in a .bin file; use one of {list(cls.__members__)}"
            )
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        return getattr(np, cls(code).name)

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> type:
        """uint16 when the vocabulary fits (< 65500 ids), else int32 (Megatron's rule)."""
        return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _write_index_file(
    path: str,
    dtype: Any,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
) -> None:
    """Write (and fsync) the ``.idx`` bytes of sequences stored back to back in ``dtype`` at ``path``."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(docs.astype("<i8", copy=False).tobytes(order="C"))
        if sequence_modes is not None:
            f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))
        f.flush()
        os.fsync(f.fileno())


def write_index(
    idx_path: str,
    dtype: Any,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
) -> None:
    """Write an ``.idx`` file for sequences stored back to back in ``dtype`` (tmp + rename)."""
    tmp = tmp_path(idx_path)
    _write_index_file(tmp, dtype, sequence_lengths, document_indices, sequence_modes)
    os.replace(tmp, idx_path)


class IndexReader:
    """Memory-mapped, validated view of an ``.idx`` file."""

    def __init__(self, idx_path: str, multimodal: bool = False) -> None:
        self.path = idx_path
        if not os.path.isfile(idx_path):
            raise DataError(f"index file {idx_path!r} does not exist")
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:9] != MAGIC:
            raise DataError(
                f"{idx_path!r} is not a Megatron .idx file (bad magic {header[:9]!r}, want {MAGIC!r})"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise DataError(f"{idx_path!r} has .idx version {version}; only version {VERSION} is supported")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in {int(c) for c in DType}:
            raise DataError(f"{idx_path!r} has an unknown dtype code {code}")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = np.dtype(self.dtype).itemsize
        n, d = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + 12 * n + 8 * d + (n if multimodal else 0)
        if size < expected:
            raise DataError(f"{idx_path!r} is truncated: {size} bytes, the header promises {expected}")
        if size not in (
            expected,
            expected + (0 if multimodal else n),
        ):  # text data may be read from a multimodal .idx
            raise DataError(
                f"{idx_path!r} is corrupt: {size} bytes, its header describes {expected} "
                f"({n} sequences, {max(d - 1, 0)} documents)"
            )
        self.sequence_count, self.document_count = int(n), int(d)
        buf = np.memmap(idx_path, mode="r", order="C")
        self._buf = buf
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=off)
        off += 8 * d
        self.sequence_modes = np.frombuffer(buf, dtype=np.int8, count=n, offset=off) if multimodal else None
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(f"{idx_path!r} is corrupt: document indices must run from 0 to {n}")

    def __len__(self) -> int:
        return self.sequence_count


class IndexedDataset:
    """Sequences of a ``.bin/.idx`` pair; ``ds[i]`` and ``ds.get(i, offset, length)`` are views.

    Args:
        path_prefix: the path without ``.bin``/``.idx``.
        multimodal: the ``.idx`` carries sequence modes.
        mmap: memory-map the ``.bin`` (``--no-mmap-bin-files`` reads with plain file I/O).

    Raises:
        DataError: a missing or corrupt file, or a ``.bin`` whose size is not exactly the end of
            the index's last document (the two files were not written together).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        self.index = IndexReader(index_file_path(self.path_prefix), self.multimodal)
        bin_path = data_file_path(self.path_prefix)
        if not os.path.isfile(bin_path):
            raise DataError(f"data file {bin_path!r} does not exist (its index {self.index.path!r} does)")
        n = self.index.sequence_count
        needed = 0
        if n:
            needed = (
                int(self.index.sequence_pointers[-1])
                + int(self.index.sequence_lengths[-1]) * self.index.dtype_size
            )
        have = os.path.getsize(bin_path)
        if have < needed:
            raise DataError(f"data file {bin_path!r} is truncated: {have} bytes, its index needs {needed}")
        if (
            have > needed
        ):  # Megatron writes exactly the tokens: more bytes mean the files were not written together
            raise DataError(
                f"data file {bin_path!r} holds {have} bytes, but its index {self.index.path!r} ends its last "
                f"document at byte {needed}: they are not one dataset (an .idx of another corpus, or a .bin "
                "written again without its .idx); write both again (tools/preprocess_data.py)"
            )
        self._bin: np.ndarray | None = None
        self._bin_size = have
        self._fd: int | None = None
        if self.mmap and have > 0:
            self._bin = np.memmap(bin_path, mode="r", order="C")
            # Held open to check, per read, that the file under the map still has the bytes: a page
            # of a mapping past the end of a file truncated meanwhile kills the process (SIGBUS).
            self._fd = os.open(bin_path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _changed(self, end: int) -> DataError:
        path = data_file_path(self.path_prefix)
        return DataError(
            f"data file {path!r} changed while training: it now holds fewer bytes than the {end} its "
            f"index needs ({self._bin_size} when the run opened it); restore it or write the dataset again"
        )

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "multimodal": self.multimodal, "mmap": self.mmap}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.index.sequence_count

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        return self.index.sequence_modes

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {idx} of length {size}")
        start = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype_size
        end = start + length * self.index.dtype_size
        if self._bin is not None:
            if self._fd is not None and os.fstat(self._fd).st_size < end:
                raise self._changed(end)
            return np.frombuffer(self._bin, dtype=self.index.dtype, count=length, offset=start)
        path = data_file_path(self.path_prefix)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length * self.index.dtype_size)
        except OSError as e:
            raise DataError(f"data file {path!r} cannot be read while training: {e}") from None
        if len(data) < length * self.index.dtype_size:
            raise self._changed(end)
        return np.frombuffer(data, dtype=self.index.dtype, count=length)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` while collecting what ``finalize`` writes into the ``.idx``.

    Nothing at ``bin_path`` or the ``.idx`` changes before ``finalize``: tokens go to a temporary
    file beside the ``.bin`` (``<name>.tmp.<pid>``, never read as data), and ``finalize`` replaces
    the pair by renames together with its checksum record ``<prefix>/checksum.json``
    (``integrity``). ``abort()`` removes the temporary files and leaves an existing pair as it was;
    a process killed before ``finalize`` leaves the old pair and a temporary file to delete.

    Args:
        bin_path: the ``.bin`` file to create.
        dtype: token dtype (``DType.optimal_dtype(vocab_size)``).
        multimodal: also record sequence modes.
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)
        self.multimodal = multimodal
        self._tmp_bin = tmp_path(bin_path)
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed by prepare or abort
        self._lengths: list[np.ndarray] = []
        self._pending: list[int] = []
        self._docs: list[np.ndarray] = []
        self._doc_pending: list[int] = []
        self._modes: list[int] = []
        self._count = 0  # sequences written so far
        self._token_range: tuple[int, int] | None = None  # (min, max) id written so far
        self._renames: list[tuple[str, str]] = []  # (temporary, final) once prepared

    def _write(self, arr: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(arr).data)
        self._token_range = integrity.merge_ranges(self._token_range, integrity.array_range(arr))

    def _flush_pending(self) -> None:
        if self._pending:
            self._lengths.append(np.asarray(self._pending, dtype=np.int32))
            self._pending = []
        if self._doc_pending:
            self._docs.append(np.asarray(self._doc_pending, dtype=np.int64))
            self._doc_pending = []

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (array-like or CPU tensor of ids)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._write(arr)
        self._pending.append(arr.size)
        self._count += 1
        if self.multimodal:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the current document (a boundary after the sequences added so far)."""
        self._doc_pending.append(self._count)

    def add_document(self, tokens: Any, lengths: Sequence[int], modes: Sequence[int] | None = None) -> None:
        """Append one document made of sequences of ``lengths`` tokens each, then close it."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._write(arr)
        self._pending.extend(int(x) for x in lengths)
        self._count += len(lengths)
        if self.multimodal:
            self._modes.extend(modes if modes is not None else [0] * len(lengths))
        self._doc_pending.append(self._count)

    def add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray | None = None
    ) -> None:
        """Append many documents at once; ``tokens`` is the concatenation of all their sequences.

        Args:
            tokens: every token of every sequence, in order.
            lengths: tokens per sequence.
            sequences_per_document: sequences per document (default: one each); 0 writes an empty
                document boundary, as Megatron does for an empty text.
        """
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int32)
        per_doc = (
            np.ones(len(lengths), dtype=np.int64)
            if sequences_per_document is None
            else np.asarray(sequences_per_document, dtype=np.int64)
        )
        if int(per_doc.sum()) != len(lengths) or int(lengths.sum(dtype=np.int64)) != arr.size:
            raise ValueError("add_documents: lengths, sequences_per_document and tokens disagree")
        self._write(arr)
        self._flush_pending()
        self._lengths.append(lengths)
        self._docs.append(self._count + np.cumsum(per_doc))
        self._count += len(lengths)
        if self.multimodal:
            self._modes.extend([0] * len(lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another dataset (same dtype)."""
        index = IndexReader(index_file_path(path_prefix), self.multimodal)
        if np.dtype(index.dtype) != self.dtype:
            raise DataError(
                f"{index.path!r} stores {np.dtype(index.dtype).name}, this builder writes {self.dtype.name}"
            )
        nbytes = int(index.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        have = os.path.getsize(data_file_path(path_prefix))
        if have != nbytes:
            raise DataError(
                f"data file {data_file_path(path_prefix)!r} holds {have} bytes, its index {index.path!r} "
                f"describes {nbytes}"
            )
        self._flush_pending()
        self._lengths.append(np.array(index.sequence_lengths, dtype=np.int32))
        self._docs.append(self._count + np.array(index.document_indices[1:], dtype=np.int64))
        self._count += index.sequence_count
        if self.multimodal and index.sequence_modes is not None:
            self._modes.extend(index.sequence_modes.tolist())
        chunk_bytes = 16 << 20  # a multiple of every itemsize
        with open(data_file_path(path_prefix), "rb") as src:
            while block := src.read(chunk_bytes):
                self._write(np.frombuffer(block, dtype=self.dtype))

    def prepare(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx`` and the checksum record, all under temporary
        names: the files at the final names are still the old ones until ``commit``."""
        self._flush_pending()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        docs = np.concatenate([np.zeros(1, np.int64)] + self._docs)
        modes = np.asarray(self._modes, dtype=np.int8) if self.multimodal else None
        tmp_idx = tmp_path(idx_path)
        _write_index_file(tmp_idx, self.dtype, lengths, docs, modes)
        self._renames = [(self._tmp_bin, self.bin_path), (tmp_idx, idx_path)]
        record = self._record_path(idx_path)
        if record is not None:
            tmp_record = tmp_path(record)
            integrity.write_record(
                integrity.make_record(self._tmp_bin, tmp_idx, self.dtype, self._token_range), tmp_record
            )
            self._renames.insert(0, (tmp_record, record))

    def _record_path(self, idx_path: str) -> str | None:
        """``<prefix>/checksum.json`` when the two files form ``<prefix>.bin/.idx`` (and ``<prefix>``
        can be a directory), else None: the pair then gets no record."""
        prefix = idx_path[: -len(".idx")]
        if not (idx_path.endswith(".idx") and self.bin_path == data_file_path(prefix)):
            return None
        try:
            os.makedirs(prefix, exist_ok=True)
        except OSError:  # <prefix> is a file
            return None
        return integrity.record_path(prefix)

    def commit(self) -> None:
        """Replace the pair (and its record) by renames; see ``integrity`` for the order."""
        if not self._renames:
            raise RuntimeError("IndexedDatasetBuilder.commit() before prepare()")
        integrity.commit(self._renames)
        self._renames = []

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin``, write the ``.idx`` and put the pair in place (``prepare`` + ``commit``)."""
        self.prepare(idx_path)
        self.commit()

    def abort(self) -> None:
        """Drop what was written: the temporary files go, an existing pair stays as it was."""
        self._file.close()
        for path in [self._tmp_bin] + [src for src, _ in self._renames]:
            if os.path.exists(path):
                os.remove(path)
        self._renames = []
