"""Delayed FP8 scaling's amax reduction across ranks (Megatron's amax reduction group): each amax
enters every rank's history as the max over the group, so the ranks of a tensor-parallel shard set
and the data-parallel replicas use the same scales. The GEMMs run emulated (fp32 on the dequantised
fp8 values), so this runs on the CPU over gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import device, distributed_test

from megatron.core.fusions.fp8 import Fp8Gemm, Fp8Recipe
from megatron.core.parallel_state import ParallelState


def _one_backward(group, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's history entry after one forward/backward, the amaxes [x, w, dy] of its inputs)."""
    gemm = Fp8Gemm(Fp8Recipe("hybrid", "delayed", 4), device=device(), use_scaled_mm=False)
    gemm.amax_group = group
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(32, 64, generator=g) * (rank + 1)).bfloat16().to(device()).requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.02 * (2 - rank)).bfloat16().to(device()).requires_grad_()
    dy = (torch.randn(32, 48, generator=g) * (rank + 3)).bfloat16().to(device())
    gemm(x, w, None).backward(dy)
    own = torch.stack([t.detach().float().abs().amax() for t in (x, w, dy)])
    return gemm.amax_history[:, 0].clone(), own


@distributed_test(world_size=2, tp=2)
def test_delayed_amaxes_enter_the_history_reduced_over_the_group(ps: ParallelState) -> None:
    rank = dist.get_rank()
    entry, own = _one_backward(ps.tp_group, rank)
    everyone = [torch.empty_like(own) for _ in range(2)]
    dist.all_gather(everyone, own)
    assert torch.equal(entry, torch.stack(everyone).amax(dim=0))
    # x's amax is rank 1's, w's rank 0's: each row took the larger one, whichever rank it came from
    assert not torch.equal(everyone[0], everyone[1]) and torch.equal(entry, torch.maximum(*everyone))
    # without a group each rank keeps its own
    entry, own = _one_backward(None, rank)
    assert torch.equal(entry, own)
