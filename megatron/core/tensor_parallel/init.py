"""Layout-invariant parameter initialisation.

Every parameter is defined as a slice of a *logical* full tensor whose values depend only on the
run's seed and the parameter's layout-independent name. The full tensor is produced on the CPU in
fixed blocks of rows, each block from its own generator seeded by (seed, name, block index): a
counter-based scheme. A rank therefore generates only the row blocks that overlap its shard (all
of them for a column split, never the whole tensor at once), and the result is bitwise identical
whatever the tensor- or pipeline-parallel layout. Nothing is ever materialised in full on the GPU.

Each parameter carries its recipe as attributes set by the layer that owns it:

* ``init_std``: normal(0, std) when > 0; ``init_value`` constant fill otherwise (0 for biases,
  1 for norm weights).
* ``partition_dim`` / ``partition_size``: the shard is rows (dim 0) or columns (dim 1) block
  ``tp_rank`` of ``partition_size`` equal blocks; ``partition_stride`` > 1 splits each of that many
  stacked sub-tensors separately (SwiGLU's gate and up halves).
* expert parameters (``moe.expert_params``): each local expert is its own logical tensor, named by
  its global expert index, so the values do not depend on the expert-parallel layout either.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

ROWS_PER_BLOCK = 256


def stable_seed(seed: int, name: str, block: int = 0) -> int:
    """A 63-bit seed from (seed, name, block) that is the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fill_rows_(
    dest: torch.Tensor,
    name: str,
    seed: int,
    full_shape: tuple[int, ...],
    std: float,
    r0: int,
    r1: int,
    dim: int = 0,
    start: int = 0,
) -> None:
    """``dest`` <- rows [r0, r1) of the logical tensor of ``full_shape``, narrowed along ``dim`` >= 1 to
    ``dest.shape[dim]`` elements from ``start`` (``dim`` 0: whole rows). One row block is generated at a
    time, in float32 on the CPU, then copied (rounded to ``dest``'s dtype, moved to its device)."""
    if r1 <= r0:
        return
    cols = full_shape[1:]
    gen = torch.Generator()
    buffer = torch.empty((min(ROWS_PER_BLOCK, full_shape[0]), *cols))  # one block, reused
    for block in range(r0 // ROWS_PER_BLOCK, (r1 - 1) // ROWS_PER_BLOCK + 1):
        b0 = block * ROWS_PER_BLOCK
        b1 = min(b0 + ROWS_PER_BLOCK, full_shape[0])
        gen.manual_seed(stable_seed(seed, name, block))
        values = torch.randn((b1 - b0, *cols), generator=gen, out=buffer[: b1 - b0]).mul_(std)
        lo, hi = max(b0, r0), min(b1, r1)
        piece = values[lo - b0 : hi - b0]
        if dim > 0:
            piece = piece.narrow(dim, start, dest.shape[dim])
        dest[lo - r0 : hi - r0].copy_(piece)


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, tp_rank: int = 0) -> None:
    """Fill ``param`` in place with its shard of the logical tensor named ``name``."""
    if param.dim() == 0:
        param.fill_(getattr(param, "init_value", 0.0))
        return
    init_param_rows_(param, param, name, seed, tp_rank, 0, param.shape[0])


@torch.no_grad()
def init_param_rows_(
    dest: torch.Tensor,
    param_like: torch.Tensor,
    name: str,
    seed: int,
    tp_rank: int,
    row_start: int,
    row_stop: int,
) -> None:
    """Fill ``dest`` with rows [row_start, row_stop) of ``param_like``'s tensor-parallel shard of the
    logical tensor named ``name``: what ``init_param_`` would write to ``param_like[row_start:row_stop]``,
    bitwise, generating only the row blocks of the logical tensor that those rows come from.

    An expert parameter (``expert_parallel``: local experts stacked along dim 0) is, for each local
    expert ``i``, its expert-tp shard (block ``etp_rank`` along ``partition_dim - 1`` of the expert's
    slice) of the logical tensor named ``f"{name}.{expert_offset + i}"``; its rows are local experts
    and ``tp_rank`` is not read (the tags carry the expert-tp rank).

    Args:
        dest: ``[row_stop - row_start, *param_like.shape[1:]]``, any dtype and device.
        param_like: carries the recipe attributes (``init_std``, ``partition_dim``, ...) and the local
            shard's shape; its values are not read (it may be on the meta device, or a DTensor).
        tp_rank: this rank's block of a tensor-parallel split.
        row_start, row_stop: a range of the local shard's rows (dim 0), e.g. a data-parallel shard.
    """
    local = tuple(param_like.shape)
    assert 0 <= row_start <= row_stop <= local[0], (name, local, row_start, row_stop)
    assert tuple(dest.shape) == (row_stop - row_start, *local[1:]), (name, tuple(dest.shape), local)
    std = getattr(param_like, "init_std", 0.0)
    if std <= 0.0:
        dest.fill_(getattr(param_like, "init_value", 0.0))
        return
    dim = getattr(param_like, "partition_dim", -1)
    parts = getattr(param_like, "partition_size", 1) if dim >= 0 else 1
    stride = getattr(param_like, "partition_stride", 1)
    if not getattr(param_like, "expert_parallel", False):
        _fill_shard_rows_(dest, local, name, seed, std, dim, parts, stride, tp_rank, row_start, row_stop)
        return
    offset, etp_rank = param_like.expert_offset, param_like.etp_rank  # type: ignore[attr-defined]
    for i in range(row_start, row_stop):
        expert = dest[i - row_start]
        if expert.dim() == 0:  # one value per expert: a 1-element logical tensor
            expert = expert.view(1)
        _fill_shard_rows_(
            expert,
            tuple(expert.shape),
            f"{name}.{offset + i}",
            seed,
            std,
            dim - 1,
            parts,
            stride,
            etp_rank,
            0,
            expert.shape[0],
        )


def _fill_shard_rows_(
    dest: torch.Tensor,
    local: tuple[int, ...],
    name: str,
    seed: int,
    std: float,
    dim: int,
    parts: int,
    stride: int,
    rank: int,
    row_start: int,
    row_stop: int,
) -> None:
    """Rows [row_start, row_stop) of block ``rank`` of ``parts`` along ``dim`` (-1: unsplit; ``stride``
    stacked sub-tensors split separately along dim 0) of the normal(0, ``std``) logical tensor
    ``name``, whose shard has shape ``local``."""
    if dim < 0 or parts == 1:
        _fill_rows_(dest, name, seed, local, std, row_start, row_stop)
        return
    full = list(local)
    full[dim] *= parts
    if dim > 0:
        # Columns: every row of the shard is a row of the logical tensor, narrowed to block ``rank``.
        _fill_rows_(dest, name, seed, tuple(full), std, row_start, row_stop, dim, rank * local[dim])
        return
    # Rows: each of ``stride`` stacked sub-tensors is split into ``parts`` row blocks; local row
    # s * sub_local + j is logical row s * sub_full + rank * sub_local + j.
    sub_full, sub_local = full[0] // stride, local[0] // stride
    for s in range(stride):
        lo, hi = max(row_start, s * sub_local), min(row_stop, (s + 1) * sub_local)
        if lo < hi:
            shift = s * sub_full + rank * sub_local - s * sub_local
            _fill_rows_(
                dest[lo - row_start : hi - row_start], name, seed, tuple(full), std, lo + shift, hi + shift
            )


def set_init_attrs(
    param: torch.Tensor,
    std: float = 0.0,
    value: float = 0.0,
    partition_dim: int = -1,
    partition_size: int = 1,
    partition_stride: int = 1,
) -> torch.Tensor:
    """Attach the initialisation and sharding recipe to ``param`` (see the module docstring)."""
    return tag_param(
        param,
        init_std=std,
        init_value=value,
        partition_dim=partition_dim,
        partition_size=partition_size,
        partition_stride=partition_stride,
        tensor_model_parallel=partition_dim >= 0 and partition_size > 1,
    )


def tag_param(param: torch.Tensor, **attrs: Any) -> torch.Tensor:
    """Attach attributes that other components read (``sequence_parallel``, ``shared_embedding_copy``, ...)."""
    for name, value in attrs.items():
        setattr(param, name, value)
    return param
