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
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
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

from megatron.core.dist_checkpointing.mapping import ShardedTensor

# key -> [(global offset, destination tensor)]: any number of blocks of one key on one rank.
LoadBlocks = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


class _BlockSavePlanner(DefaultSavePlanner):
    """Writes the given main-replica blocks and pickled objects; ignores DCP's ``state_dict``."""

    def __init__(self, tensors: list[ShardedTensor], objects: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors = tensors
        self._by_block: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {
            (t.key, tuple(t.global_offset)): t.data for t in tensors
        }
        self._objects = objects

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for t in self._tensors:
            offsets = torch.Size(t.global_offset)
            items.append(
                WriteItem(
                    index=MetadataIndex(t.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(t.local_shape)),
                        properties=TensorProperties.create_from_tensor(t.data.detach()),
                        size=torch.Size(t.global_shape),
                    ),
                )
            )
        items.extend(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._objects[fqn], buf)
            buf.seek(0)
            return buf
        offset = tuple(write_item.index.offset or ())
        return self._by_block[(fqn, offset)].detach()


class _BlockLoadPlanner(DefaultLoadPlanner):
    """Reads global blocks into destination tensors (in place) and unpickles objects."""

    def __init__(self, blocks: LoadBlocks, object_keys: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = blocks
        self._object_keys = object_keys
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
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


@contextlib.contextmanager
def _reraise(what: str) -> Iterator[None]:
    """DCP reports rank failures as CheckpointException, a BaseException; make it a RuntimeError."""
    try:
        yield
    except CheckpointException as e:
        raise RuntimeError(f"{what} failed on ranks {sorted(e.failures)}:\n{e}") from e


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def dcp_save(
    tensors: list[ShardedTensor], objects: dict[str, Any], checkpoint_dir: str, process_group: Any = None
) -> None:
    """Collective (over ``process_group``): write this rank's blocks and objects with DCP."""
    writer = dcp.FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True)
    with warnings.catch_warnings(), _reraise(f"writing checkpoint {checkpoint_dir}"):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(
            {},
            storage_writer=writer,
            planner=_BlockSavePlanner(tensors, objects),
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
    """Collective unless ``no_dist``: fill ``blocks`` in place; return the requested objects by key."""
    planner = _BlockLoadPlanner(blocks, object_keys)
    with warnings.catch_warnings(), torch.no_grad(), _reraise(f"reading checkpoint {checkpoint_dir}"):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(
            {},
            storage_reader=dcp.FileSystemReader(checkpoint_dir),
            planner=planner,
            process_group=process_group,
            no_dist=no_dist or _no_dist(),
        )
    return planner.objects


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP ``.metadata`` of a checkpoint: keys, global shapes, dtypes and saved chunks."""
    return dcp.FileSystemReader(checkpoint_dir).read_metadata()
