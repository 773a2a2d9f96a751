"""Delayed FP8 scaling's amax reduction across ranks (Megatron's amax reduction group): each amax
enters every rank's history as the max over the group, so the ranks of a tensor-parallel shard set
and the data-parallel replicas use the same scales. The GEMMs run emulated (fp32 on the dequantised
fp8 values), so this runs on the CPU over gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import device, distributed_test

from megatron.core.fusions.fp8 import AmaxReducer, Fp8Gemm, Fp8Recipe
from megatron.core.parallel_state import ParallelState


def _one_backward(group, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's history entry after one forward/backward, the amaxes [x, w, dy] of its inputs)."""
    reducer = AmaxReducer(group) if group is not None else None
    gemm = Fp8Gemm(Fp8Recipe("hybrid", "delayed", 4), device=device(), use_scaled_mm=False, reducer=reducer)
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


@distributed_test(world_size=2, tp=2)
def test_one_amax_reduction_per_backward_for_all_gemms(ps: ParallelState) -> None:
    """Three GEMMs in one backward: one all-reduce carries all their amaxes, and each history gets
    the max over the ranks of its own tensors (as a reduction per GEMM gives)."""
    rank = dist.get_rank()
    recipe = Fp8Recipe("hybrid", "delayed", 4)
    reducer = AmaxReducer(ps.tp_group)  # the trainer's: one for every GEMM of the model
    gemms = [Fp8Gemm(recipe, device=device(), use_scaled_mm=False, reducer=reducer) for _ in range(3)]
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        g = torch.Generator().manual_seed(rank)
        x = (torch.randn(32, 64, generator=g) * (rank + 1)).bfloat16().to(device()).requires_grad_()
        ws = [
            (torch.randn(64, 64, generator=g) * 0.02 * (i + 1 + rank))
            .bfloat16()
            .to(device())
            .requires_grad_()
            for i in range(3)
        ]

        def forward_backward() -> None:
            h = x
            for gemm, w in zip(gemms, ws):
                h = gemm(h, w, None)
            h.float().square().sum().backward()

        forward_backward()
        assert calls == [(3, 3)]  # one all-reduce of the three GEMMs' [x, w, dy] amaxes
        for gemm in gemms:
            own = gemm.amax_history[:, 0].clone()
            everyone = [torch.empty_like(own) for _ in range(2)]
            assert gemm.warm and bool(gemm.initialized.all())
            # every rank holds the same reduced entry
            real(own, op=dist.ReduceOp.MAX)
            assert torch.equal(gemm.amax_history[:, 0], own)
            dist.all_gather(everyone, own)
            assert torch.equal(everyone[0], everyone[1])
        # x differs per rank: its entry is the larger of the two ranks' amaxes, not this rank's own
        x_amaxes = [torch.empty(()) for _ in range(2)]
        dist.all_gather(x_amaxes, x.detach().float().abs().amax())
        assert x_amaxes[0] != x_amaxes[1] and gemms[0].amax_history[0, 0] == max(x_amaxes)
        # a second backward: one more all-reduce, the histories move by one entry
        calls.clear()
        first = [gemm.amax_history[:, 0].clone() for gemm in gemms]
        forward_backward()
        assert calls == [(3, 3)]
        for gemm, entry in zip(gemms, first):
            assert torch.equal(gemm.amax_history[:, 1], entry)
    finally:
        dist.all_reduce = real
