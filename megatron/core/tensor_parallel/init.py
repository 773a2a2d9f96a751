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


def _logical_rows(
    name: str, seed: int, full_shape: tuple[int, ...], std: float, r0: int, r1: int
) -> torch.Tensor:
    """Rows [r0, r1) of the logical tensor, float32 on the CPU."""
    cols = full_shape[1:]
    out = torch.empty((r1 - r0, *cols), dtype=torch.float32)
    first, last = r0 // ROWS_PER_BLOCK, (r1 - 1) // ROWS_PER_BLOCK
    gen = torch.Generator()
    for block in range(first, last + 1):
        b0 = block * ROWS_PER_BLOCK
        b1 = min(b0 + ROWS_PER_BLOCK, full_shape[0])
        gen.manual_seed(stable_seed(seed, name, block))
        values = torch.randn((b1 - b0, *cols), generator=gen) * std
        lo, hi = max(b0, r0), min(b1, r1)
        out[lo - r0 : hi - r0] = values[lo - b0 : hi - b0]
    return out


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, tp_rank: int = 0) -> None:
    """Fill ``param`` in place with its shard of the logical tensor named ``name``."""
    std = getattr(param, "init_std", 0.0)
    if std <= 0.0:
        param.fill_(getattr(param, "init_value", 0.0))
        return
    dim = getattr(param, "partition_dim", -1)
    parts = getattr(param, "partition_size", 1) if dim >= 0 else 1
    stride = getattr(param, "partition_stride", 1)
    local = tuple(param.shape)
    if parts == 1:
        param.copy_(_logical_rows(name, seed, local, std, 0, local[0]).to(param.dtype))
        return
    full = list(local)
    full[dim] *= parts
    if dim == 0:
        # Rows: each of ``stride`` stacked sub-tensors is split into ``parts`` row blocks.
        sub_full, sub_local = full[0] // stride, local[0] // stride
        pieces = [
            _logical_rows(
                name,
                seed,
                tuple(full),
                std,
                s * sub_full + tp_rank * sub_local,
                s * sub_full + (tp_rank + 1) * sub_local,
            )
            for s in range(stride)
        ]
        param.copy_(torch.cat(pieces, 0).to(param.dtype))
    else:
        rows = _logical_rows(name, seed, tuple(full), std, 0, full[0])
        param.copy_(rows.narrow(dim, tp_rank * local[dim], local[dim]).to(param.dtype))


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
