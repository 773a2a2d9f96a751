"""The router's choices, gradients, logged aux losses, statistics and expert-bias update are the
same when the tokens are split over two ranks as on one rank: over tp with sequence parallelism
(and tp replicas without it), over cp, and over dp for the global-batch loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import device, distributed_test
from torch.testing import assert_close

from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.moe import moe_utils as mu
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, H, E = 4, 2, 8, 4  # [s, b, h]; s splits over 2 ranks
NUM_LAYERS = 2


def _config(**moe: object) -> TransformerConfig:
    fields = {"num_moe_experts": E, "moe_router_topk": 2} | moe
    return TransformerConfig(num_layers=NUM_LAYERS, hidden_size=H, num_attention_heads=1, **fields)


def _run(router: TopKRouter, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training forward / backward of ``sum(probs * g)``; probs, map and the gradients."""
    router.train()
    x = x.clone().requires_grad_(True)
    probs, routing_map = router(x)
    (probs * g).sum().backward()
    return {
        "probs": probs.detach(),
        "map": routing_map,
        "dx": x.grad.reshape(-1, H),
        "dw": router.weight.grad,
    }


CASES = [
    {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01},
    {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1},
    {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 0.1},
    {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_aux_loss_coeff": 0.1,
        "moe_expert_capacity_factor": 2.0,
    },
]
GLOBAL_ONLY = [CASES[2]]


def _check_layout(
    ps: ParallelState, split: int, rank: int, sp: bool, case: dict, keys: tuple[str, ...]
) -> None:
    """Rank ``rank`` of ``split`` holds sequence rows ``[rank * S / split, ...)`` (all of them at
    split 1: tp replicas); compare with the one-rank router on all tokens."""
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(S, B, H, generator=gen), torch.randn(S * B, E, generator=gen)
    mu.MoEAuxLossAutoScaler.set_loss_scale(1.0)
    mu.clear_aux_losses_tracker()  # a forked rank inherits the parent's tracker

    ref_router = TopKRouter(_config(sequence_parallel=False, **case))  # same init: seeded by layer
    ref = _run(ref_router, x, g)
    ref_log = mu.track_moe_metrics(1.0, num_layers=NUM_LAYERS)
    if ref_router.expert_bias is not None:
        mu.update_expert_bias(ref_router)

    groups = MoEGroups.of(ps)
    router = TopKRouter(_config(sequence_parallel=sp, **case), groups)
    rows = slice(rank * S // split, (rank + 1) * S // split)
    tokens = slice(rows.start * B, rows.stop * B)
    out = _run(router, x[rows].to(device()), g[tokens].to(device()))
    assert torch.equal(out["map"].cpu(), ref["map"][tokens])
    assert_close(out["probs"].cpu(), ref["probs"][tokens])
    assert_close(out["dx"].cpu(), ref["dx"][tokens])
    dw = out["dw"].clone()
    if split > 1:  # each rank's weight gradient covers its tokens (summed over tp by sp / DDP)
        dist.all_reduce(dw, group=groups.tp_dp_cp)
    assert_close(dw.cpu(), ref["dw"])
    log = mu.track_moe_metrics(1.0, num_layers=NUM_LAYERS, pp_group=ps.pp_group, dp_group=ps.dp_group)
    for k in keys:
        assert k in ref_log and log[k] == pytest.approx(ref_log[k], rel=1e-5), (k, log, ref_log)
    if router.expert_bias is not None:
        mu.update_expert_bias(router)
        assert_close(router.expert_bias.cpu(), ref_router.expert_bias)
        assert ref_router.expert_bias.abs().sum() > 0


STATS = ("expert_load_imbalance", "dropped_token_fraction")
LOSSES = {
    0: ("load_balancing_loss", "z_loss"),
    1: ("seq_load_balancing_loss",),
    2: ("global_load_balancing_loss",),
    3: ("load_balancing_loss",),
}


@distributed_test(world_size=2, tp=2)
def test_router_is_layout_invariant_over_tp(ps: ParallelState) -> None:
    for i, case in enumerate(CASES):
        _check_layout(ps, 2, ps.tp_rank, True, case, LOSSES[i] + STATS)
        # Without sequence parallelism both tp ranks hold every token.
        _check_layout(ps, 1, 0, False, case, LOSSES[i] + STATS)


@distributed_test(world_size=2, cp=2)
def test_router_is_layout_invariant_over_cp(ps: ParallelState) -> None:
    for i, case in enumerate(CASES[:2]):
        _check_layout(ps, 2, ps.cp_rank, False, case, LOSSES[i] + STATS)


@distributed_test(world_size=2)
def test_global_aux_loss_sums_over_data_parallel_ranks(ps: ParallelState) -> None:
    # dp 2: the tp_cp group is one rank, tp_dp_cp both; only the global-batch loss spans them.
    _check_layout(ps, 2, ps.dp_rank, False, CASES[2], LOSSES[2])
