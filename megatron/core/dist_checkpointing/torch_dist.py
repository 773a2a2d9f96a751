"""The ``torch_dist`` backend: ShardedTensor blocks written and read through torch.distributed.checkpoint.

No DTensor and no ``torch.distributed._shard`` tensors are involved. Two small planners talk to DCP
directly in its own vocabulary:

* ``_BlockSavePlanner`` turns each locally held main-replica block into a ``WriteItem`` of type
  ``SHARD`` whose ``ChunkStorageMetadata`` carries the block's global offset and size, and whose
  ``TensorWriteData.size`` is the global shape. DCP's coordinator merges the chunks of all ranks into
  one ``TensorStorageMetadata`` per key (the ``.metadata`` file), exactly as it does for its own
  sharded tensors.
* ``_BlockLoadPlanner`` asks for any global block (offset, size) of a saved tensor;
  ``create_read_items_for_chunk_list`` intersects it with the saved chunks, which is what makes a
  checkpoint readable under a different layout (resharding).

Non-tensor values travel as ``BYTE_IO`` items (``torch.save`` pickles). Everything used here is public
DCP planner API present in torch 2.11 and 2.13.

Failures of the files themselves are one-line ``CheckpointWriteError`` / ``CheckpointReadError`` naming the
file and the OS error (``_CheckedFileSystem`` keeps the OSError that ``torch.save`` would drop); any
other failure is a ``RuntimeError`` with DCP's per-rank tracebacks.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.dist_checkpointing.errors import CheckpointReadError, CheckpointWriteError
from megatron.core.dist_checkpointing.mapping import ShardedTensor

# key -> [(global offset, destination tensor)]: any number of blocks of one key on one rank.
LoadBlocks = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


def save_state(tensors: list[ShardedTensor], objects: dict[str, Any]) -> dict[str, Any]:
    """What DCP is given to write: the blocks' data in ``tensors``' order and each object pickled
    (``torch.save``) by key, so that the objects are captured as they are now; an asynchronous save's
    stager copies the tensors. ``_BlockSavePlanner`` reads it back."""
    pickled = {}
    for key, value in objects.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        pickled[key] = buf.getvalue()
    return {"tensors": [t.local_data().detach() for t in tensors], "objects": pickled}


class _BlockSavePlanner(DefaultSavePlanner):
    """Writes the main-replica blocks ``tensors`` describe and the pickled objects, taking their data
    from the state dict DCP is given (``save_state``'s layout: the original or a staged copy).

    The write items (keys, offsets, shapes, tensor properties) are made from ``tensors`` when the planner
    is built, so a staged copy (pinned host memory) is written under the same metadata as the original.
    """

    def __init__(self, tensors: list[ShardedTensor], object_keys: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._index = {(t.key, tuple(t.global_offset)): i for i, t in enumerate(tensors)}
        self._items = [_write_item(t) for t in tensors]
        self._items.extend(
            WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in object_keys
        )
        self._data: list[torch.Tensor] = []
        self._objects: dict[str, bytes] = {}

    def set_up_planner(
        self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._data, self._objects = state_dict["tensors"], state_dict["objects"]

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items))
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[fqn])
        offset = tuple(write_item.index.offset or ())
        return self._data[self._index[(fqn, offset)]]


def _write_item(t: ShardedTensor) -> WriteItem:
    offsets = torch.Size(t.global_offset)
    return WriteItem(
        index=MetadataIndex(t.key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(t.local_shape)),
            properties=TensorProperties.create_from_tensor(t.local_data().detach()),
            size=torch.Size(t.global_shape),
        ),
    )


class _BlockLoadPlanner(DefaultLoadPlanner):
    """Reads global blocks into destination tensors (in place) and unpickles objects."""

    def __init__(self, blocks: LoadBlocks, object_keys: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = blocks
        self._object_keys = object_keys
        self.objects: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, blocks in self._blocks.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata), key
            chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=dest.shape) for off, dest in blocks]
            # each ReadItem's dest_index.index is the position of its chunk in ``chunks``
            items.extend(create_read_items_for_chunk_list(key, md, chunks))
        for key in self._object_keys:
            index = MetadataIndex(key)
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=index,
                    dest_offsets=torch.Size((0,)),
                    storage_index=index,
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        assert index.index is not None, index
        offset, dest = self._blocks[index.fqn][index.index]
        assert tuple(index.offset or ()) == offset, (index, offset)
        dest = dest.detach()
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already in place


class _RecordingFileIO(io.FileIO):
    """A file that keeps the first OSError of its writes."""

    first_error: OSError | None = None

    def write(self, b: Any) -> int:
        try:
            return super().write(b)
        except OSError as e:
            if self.first_error is None:
                self.first_error = e
            raise


def _with_path(error: OSError, path: Any) -> OSError:
    """``error`` naming ``path`` (a failed ``write`` or ``fsync`` names no file)."""
    if error.filename is not None or error.errno is None:
        return error
    return OSError(error.errno, error.strerror, os.fspath(path))


class _CheckedFileSystem(FileSystem):
    """DCP's local file system, where a failed write surfaces as the OSError it was.

    DCP writes tensors with ``torch.save``, whose zip writer turns a failed ``write`` (ENOSPC, EDQUOT,
    EIO) into "unexpected pos N vs M" and drops the OSError. A file opened for writing here keeps the
    first OSError of its writes and raises it, with the file's path, in place of what it caused; a
    file whose write failed never leaves its ``with`` block quietly.
    """

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        raw = _RecordingFileIO(os.fspath(path), mode.replace("b", ""))
        try:
            with io.BufferedWriter(raw) as stream:
                yield stream
        except Exception as e:
            error = raw.first_error or (e if isinstance(e, OSError) else None)
            if error is None:
                raise
            error = _with_path(error, path)
            if error is e:
                raise
            raise error from e
        if raw.first_error is not None:
            raise _with_path(raw.first_error, path)


def _os_errors(e: CheckpointException) -> dict[int, OSError]:
    """Rank -> the OSError it failed with (directly or as the cause of its error), for the ranks that did."""
    found: dict[int, OSError] = {}
    for rank, failure in e.failures.items():
        exc: BaseException | None = failure[0] if isinstance(failure, tuple) else failure
        while exc is not None and not isinstance(exc, OSError):
            exc = exc.__cause__
        if exc is not None:
            found[rank] = exc
    return found


def _describe_os_errors(errors: dict[int, OSError]) -> str:
    ranks = sorted(errors)
    if len(ranks) == 1:
        where = f"rank {ranks[0]}"
    else:
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        where = f"ranks {shown}; rank {ranks[0]}'s error shown"
    return f"{errors[ranks[0]]} ({where})"


@contextlib.contextmanager
def _reraise(what: str, io_error: Callable[[str], ValueError]) -> Iterator[None]:
    """DCP reports rank failures as CheckpointException, a BaseException (every rank gets every rank's
    failure). An OS error on any rank becomes ``io_error(reason)`` (one line, the same on every rank);
    any other failure a RuntimeError with DCP's tracebacks."""
    try:
        yield
    except CheckpointException as e:
        os_errors = _os_errors(e)
        if os_errors:
            raise io_error(_describe_os_errors(os_errors)) from None
        raise RuntimeError(f"{what} failed on ranks {sorted(e.failures)}:\n{e}") from e


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _writer(checkpoint_dir: str) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True)
    if type(getattr(writer, "fs", None)) is FileSystem:  # DCP's own local file system: report its OS errors
        writer.fs = _CheckedFileSystem()
    return writer


def dcp_save(
    tensors: list[ShardedTensor], objects: dict[str, Any], checkpoint_dir: str, process_group: Any = None
) -> None:
    """Collective (over ``process_group``): write this rank's blocks and objects with DCP.

    Raises:
        CheckpointWriteError: a file could not be written on some rank (on every rank, the same).
    """
    with (
        warnings.catch_warnings(),
        _reraise(
            f"writing checkpoint {checkpoint_dir}",
            lambda reason: CheckpointWriteError(checkpoint_dir, reason),
        ),
    ):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(
            save_state(tensors, objects),
            storage_writer=_writer(checkpoint_dir),
            planner=_BlockSavePlanner(tensors, list(objects)),
            process_group=process_group,
            no_dist=_no_dist(),
        )


def dcp_load(
    blocks: LoadBlocks,
    object_keys: list[str],
    checkpoint_dir: str,
    process_group: Any = None,
    no_dist: bool = False,
) -> dict[str, Any]:
    """Collective unless ``no_dist``: fill ``blocks`` in place; return the requested objects by key.

    Raises:
        CheckpointReadError: a file could not be read on some rank.
    """
    planner = _BlockLoadPlanner(blocks, object_keys)
    with (
        warnings.catch_warnings(),
        torch.no_grad(),
        _reraise(
            f"reading checkpoint {checkpoint_dir}",
            lambda reason: CheckpointReadError(f"cannot read checkpoint {checkpoint_dir}: {reason}"),
        ),
    ):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(
            {},
            storage_reader=dcp.FileSystemReader(checkpoint_dir),
            planner=planner,
            process_group=process_group,
            no_dist=no_dist or _no_dist(),
        )
    return planner.objects


DCP_METADATA_FILE = ".metadata"


# What unpickling a damaged or foreign file raises.
_UNPICKLE_ERRORS = (
    OSError,
    EOFError,
    pickle.UnpicklingError,
    ValueError,
    TypeError,
    AttributeError,
    ImportError,
    KeyError,
    IndexError,
    UnicodeDecodeError,
    OverflowError,
    MemoryError,
)


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP ``.metadata`` of a checkpoint (keys, global shapes, dtypes and saved chunks), checked to be
    DCP's index.

    Raises:
        CheckpointReadError: ``.metadata`` is missing, empty, cannot be unpickled or is not DCP metadata.
    """
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointReadError(
            f"{path} is missing (DCP's index of the saved tensors): the checkpoint is damaged"
        )
    if os.path.getsize(path) == 0:
        raise CheckpointReadError(f"{path} is empty (0 bytes): the checkpoint is damaged")
    try:
        md = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    except _UNPICKLE_ERRORS as e:
        raise CheckpointReadError(
            f"{path} cannot be read ({type(e).__name__}: {e}): the checkpoint is damaged"
        ) from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointReadError(
            f"{path} holds a {type(md).__name__}, not DCP's index of the saved tensors: the checkpoint is damaged"
        )
    return md


def file_problems(checkpoint_dir: str, md: Metadata, keys: set[str] | None = None) -> list[str]:
    """The data files of the checkpoint (those holding ``keys``, default all) that are missing or shorter
    than ``.metadata`` records: one message each, naming the file."""
    needed: dict[str, int] = {}  # file -> bytes the items stored in it end at
    wanted: set[str] = set()
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        name = info.relative_path
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
        if keys is None or index.fqn in keys:
            wanted.add(name)
    problems = []
    for name in sorted(wanted):
        path = os.path.join(checkpoint_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size < needed[name]:
            problems.append(f"{path} is truncated ({size} bytes; {DCP_METADATA_FILE} records {needed[name]})")
    return problems
