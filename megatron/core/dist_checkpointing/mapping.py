"""Sharded state dict vocabulary: how a local tensor relates to the global tensor it is a piece of.

A model's ``sharded_state_dict(prefix)`` returns a (nested) dict whose leaves are ``ShardedTensor``
or ``ShardedObject``. Keys and global shapes never depend on the parallel layout, so a checkpoint
written under one layout can be read under another: each rank asks for exactly the global slices
it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ReplicaId = int | tuple[int, ...]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (all zeros) is the one that writes a shard."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """A local tensor ``data`` that is the block at ``global_offset`` of a global tensor.

    Attributes:
        key: layout-independent global name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``.
        data: the local shard.
        global_shape: shape of the whole logical tensor.
        global_offset: element offset of ``data`` along each axis of the global tensor.
        replica_id: which copy this is when several ranks hold the same shard; 0 (or all zeros)
            marks the main replica, the only one that is written.
        allow_shape_mismatch: the global shape may differ on load (padded vocabularies).
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0
    allow_shape_mismatch: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Build from ``(axis, rank_along_axis, num_fragments)`` triples (even splits only)."""
        global_shape = list(data.shape)
        global_offset = [0] * data.dim()
        for axis, rank, fragments in rank_offsets:
            if not 0 <= rank < fragments:
                raise ValueError(f"{key}: rank {rank} outside [0, {fragments}) on axis {axis}")
            global_shape[axis] = data.shape[axis] * fragments
            global_offset[axis] = data.shape[axis] * rank
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id, allow_shape_mismatch)

    def validate(self) -> None:
        for ax, (off, loc, glob) in enumerate(zip(self.global_offset, self.local_shape, self.global_shape)):
            if off < 0 or off + loc > glob:
                raise ValueError(f"{self.key}: shard [{off}, {off + loc}) exceeds global size {glob} on axis {ax}")


@dataclass
class ShardedObject:
    """A picklable non-tensor value, one per ``key`` (``replica_id`` 0 writes it).

    ``shard_key`` distinguishes per-rank objects that must not be merged (for example the RNG state
    of each tensor/pipeline rank); leave it empty for one object shared by all ranks.
    """

    key: str
    data: Any
    replica_id: ReplicaId = 0
    shard_key: str = field(default="")

    @property
    def unique_key(self) -> str:
        return f"{self.key}/{self.shard_key}" if self.shard_key else self.key
