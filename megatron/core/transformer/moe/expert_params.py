"""How expert parameters are tagged. An expert parameter stacks this rank's local experts along
dim 0: ``[E_local, ...]``, local expert ``i`` is global expert ``expert_offset + i``. Its other dims
may be split over expert-tp exactly as a dense tensor-parallel weight is over tp (``partition_dim``
>= 1 of the stacked tensor, ``partition_size`` = etp, ``partition_stride`` for SwiGLU's [gate; up]),
with this rank's block ``etp_rank``.

What reads the tags:

* initialisation: each local expert ``i`` is the shard of the logical 2-D tensor named
  ``f"{name}.{expert_offset + i}"`` (layout-invariant: the same values whatever ep / etp);
* gradient reduction: ``allreduce = False`` (Megatron-Core's marker) puts the parameter in the expert
  buckets, reduced over the expert-data-parallel group instead of dp x cp;
* the distributed optimizer shards it over expert-dp; the gradient norm sums it over ep x etp x pp;
* checkpoints store it under global expert indices: dim 0 is block ``ep_rank`` of ``ep_size`` of the
  ``[E, ...]`` tensor, the split dim block ``etp_rank`` of ``partition_size``, replicated over
  expert-dp.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.init import set_init_attrs, tag_param


def tag_expert_param(
    param: torch.Tensor,
    *,
    num_experts: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: int,
    init_std: float = 0.0,
    init_value: float = 0.0,
    partition_dim: int = -1,
    partition_size: int = 1,
    partition_stride: int = 1,
) -> torch.Tensor:
    """Tag ``param`` ``[E_local, ...]`` as this rank's slice of an expert weight (module docstring)."""
    assert num_experts % ep_size == 0 and param.shape[0] == num_experts // ep_size, (
        tuple(param.shape),
        num_experts,
        ep_size,
    )
    assert partition_dim != 0, "dim 0 of an expert parameter is the expert index"
    set_init_attrs(
        param,
        std=init_std,
        value=init_value,
        partition_dim=partition_dim,
        partition_size=partition_size,
        partition_stride=partition_stride,
    )
    return tag_param(
        param,
        allreduce=False,
        expert_parallel=True,
        num_experts=num_experts,
        num_local_experts=param.shape[0],
        expert_offset=ep_rank * param.shape[0],
        ep_rank=ep_rank,
        ep_size=ep_size,
        etp_rank=etp_rank,
    )


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (reduced over expert-dp, not dp x cp)."""
    return not getattr(param, "allreduce", True)
