"""A flat range of a tensor's elements as rectangular blocks, for checkpointing flat shards.

The distributed optimizer owns a contiguous slice of each gradient bucket and FSDP2 a dim-0 slice of
each parameter: in both, what a rank holds of one parameter is the elements ``[start, stop)`` of its
local (tensor-parallel) shard in row-major order. Such a range is a union of at most ``2 * ndim - 1``
rectangles (a partial first row, whole rows, a partial last row, recursively), and each rectangle of a
contiguous tensor is contiguous in the flat order. Checkpointing each rectangle as a block of the
parameter's global tensor keeps the keys and global shapes of the unsharded layouts, so checkpoints
reshard between any of them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedTensor

# (offset per axis, size per axis, flat start) of one rectangle of a local tensor.
Rect = tuple[tuple[int, ...], tuple[int, ...], int]


def flat_range_rects(shape: tuple[int, ...], start: int, stop: int) -> list[Rect]:
    """The rectangles covering elements ``[start, stop)`` of a row-major tensor of ``shape``, in order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    rects: list[Rect] = []

    def sub(row: int, lo: int, hi: int) -> None:
        for off, size, flat in flat_range_rects(tuple(shape[1:]), lo, hi):
            rects.append(((row, *off), (1, *size), row * inner + flat))

    row, lo = divmod(start, inner)
    if lo:
        end = min(stop, (row + 1) * inner)
        sub(row, lo, end - row * inner)
        start, row = end, row + 1
    full_end = stop // inner
    if start < stop and full_end > row:
        rects.append(((row, *(0,) * (len(shape) - 1)), (full_end - row, *shape[1:]), row * inner))
        start, row = full_end * inner, full_end
    if start < stop:
        sub(row, 0, stop - row * inner)
    return rects


def flat_range_blocks(
    st: ShardedTensor,
    data: torch.Tensor,
    start: int,
    stop: int,
    *,
    key: str | None = None,
    replica_id: ReplicaId | None = None,
) -> list[ShardedTensor]:
    """Elements ``[start, stop)`` of ``st``'s local tensor (row-major) as blocks of ``st``'s global tensor.

    ``data`` is 1-D with ``stop - start`` elements (any dtype: an optimizer state of a bf16 weight is
    fp32); each block's data is a view into it. ``key`` and ``replica_id`` default to ``st``'s.
    """
    assert data.dim() == 1 and data.numel() == stop - start, "data holds exactly the range"
    p = st.prepend_axis_num
    base = st.global_offset[p:]
    blocks = []
    for off, size, flat in flat_range_rects(tuple(st.local_shape), start, stop):
        piece = data[flat - start : flat - start + math.prod(size)].view(size)
        blocks.append(
            replace(
                st,
                key=st.key if key is None else key,
                data=piece,
                dtype=piece.dtype,
                local_shape=tuple(size),
                global_offset=(*st.global_offset[:p], *(b + o for b, o in zip(base, off))),
                axis_fragmentations=None,
                replica_id=st.replica_id if replica_id is None else replica_id,
            )
        )
    return blocks
