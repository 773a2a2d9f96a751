"""The MoE layer under expert, expert-tensor and tensor (sequence) parallelism, with both token
dispatchers, equals the one-rank layer on the same logical experts and the same global tokens:
output, input gradient and every weight gradient (fp32, 1e-5); with capacity dropping or padding
(per-rank capacity) the one-rank layer on each rank's tokens. The initialisation from the parameter
tags gives each rank its slice of the one-rank layer's values. One spawn of 4 gloo ranks runs
every layout in turn, each with its own groups."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from torch.testing import assert_close

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state import ParallelState
from megatron.core.parallel_state_grid import build_parallel_state
from megatron.core.tensor_parallel.init import init_param_
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, H, FFN, SHARED, E = 8, 8, 8, 16, 8, 4
TOL = dict(rtol=1e-5, atol=1e-5)

# (tp, ep, etp): tp > 1 runs with sequence parallelism; etp None = tp.
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, None), (2, 2, 1), (1, 2, 2), (2, 1, None)]
# Layouts also run with capacity dropping (allgather) and padding to capacity (alltoall).
CAPACITY_LAYOUTS = [(1, 4, 1), (2, 2, None)]


def moe_config(**overrides: object) -> SimpleNamespace:
    """A TransformerConfig's defaults as a namespace (no checks run): a tiny SwiGLU MoE, top-2,
    no auxiliary loss (routing depends on the tokens only)."""
    base = {
        f.name: f.default
        for f in dataclasses.fields(TransformerConfig)
        if f.default is not dataclasses.MISSING
    }
    base.update(
        num_layers=2,
        hidden_size=H,
        ffn_hidden_size=32,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=2,
        activation="swiglu",
        add_bias_linear=False,
        params_dtype=torch.float32,
        init_method_std=0.3,
        output_layer_init_std=0.2,
        gelu_approximation="none",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        sequence_parallel=False,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def _logical(seed: int) -> dict[str, torch.Tensor]:
    """The full weights every layout slices from."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.4

    return {
        "router.weight": randn(E, H),
        "experts.linear_fc1.weight": randn(E, 2 * FFN, H),
        "experts.linear_fc2.weight": randn(E, H, FFN),
        "shared_experts.gate_weight": randn(1, H),
        "shared_experts.linear_fc1.weight": randn(2 * SHARED, H),
        "shared_experts.linear_fc2.weight": randn(H, SHARED),
    }


def _strided_block(t: torch.Tensor, dim: int, rank: int, size: int, stride: int) -> torch.Tensor:
    """Block ``rank`` of ``size`` of each of ``stride`` stacked parts of ``dim`` (SwiGLU's [gate; up])."""
    parts = t.chunk(stride, dim)
    return torch.cat([p.chunk(size, dim)[rank] for p in parts], dim)


def _shard(name: str, full: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """This rank's slice of a logical weight (or of its gradient)."""
    if name.startswith("experts."):
        e_local = E // ps.ep_size
        full = full[ps.ep_rank * e_local : (ps.ep_rank + 1) * e_local]
        dim, stride = (1, 2) if "fc1" in name else (2, 1)
        return _strided_block(full, dim, ps.expt_tp_rank, ps.expt_tp_size, stride)
    if name == "shared_experts.linear_fc1.weight":
        return _strided_block(full, 0, ps.tp_rank, ps.tp_size, 2)
    if name == "shared_experts.linear_fc2.weight":
        return full.chunk(ps.tp_size, 1)[ps.tp_rank]
    return full


def _reduce_group(name: str, ps: ParallelState) -> dist.ProcessGroup | None:
    """The ranks whose gradients of ``name`` sum to the one-rank gradient of this rank's slice."""
    if name.startswith("experts."):
        return ps.groups["expt_dp"]
    if name.startswith("shared_experts.linear"):
        return ps.groups["dp"]
    return dist.group.WORLD  # replicated weights: every rank's tokens


def _run(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _case(
    ps: ParallelState, tp: int, dispatcher: str, grouped: bool, capacity: tuple | None, weights, x, dy
) -> None:
    """``capacity``: None, or ``(factor, pad)``; capacity is per rank (Megatron-Core's rule), so the
    reference is then the one-rank layer on this rank's tokens, its weight gradients summed over
    the world."""
    sp = tp > 1
    overrides = dict(
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
        moe_ffn_hidden_size=FFN,
        moe_shared_expert_intermediate_size=SHARED,
        moe_shared_expert_gate=True,
    )
    if capacity is not None:
        overrides.update(moe_expert_capacity_factor=capacity[0], moe_pad_expert_input_to_capacity=capacity[1])

    def local(t: torch.Tensor) -> torch.Tensor:  # [S, B, h] -> this rank's [S / tp, B / dp, h]
        t = t.chunk(ps.dp_size, 1)[ps.dp_rank]
        return t.chunk(ps.tp_size, 0)[ps.tp_rank].contiguous()

    ref = MoELayer(moe_config(**overrides))
    ref.load_state_dict(weights)
    if capacity is None:
        y_ref, dx_ref, dw_ref = _run(ref, x, dy)
        y_ref, dx_ref = local(y_ref), local(dx_ref)
    else:
        y_ref, dx_ref, dw_ref = _run(ref, local(x), local(dy))
        for grad in dw_ref.values():
            dist.all_reduce(grad)

    groups = MoEGroups.of(ps)
    if sp:
        with pytest.raises(ConfigError, match="sequence_parallel"):
            MoELayer(moe_config(**overrides), tp_group=ps.tp_group, moe_groups=groups)
    layer = MoELayer(
        moe_config(sequence_parallel=sp, **overrides),
        tp_group=ps.tp_group,
        sequence_parallel=sp,
        moe_groups=groups,
    )
    layer.load_state_dict({n: _shard(n, w, ps) for n, w in weights.items()})
    y, dx, dw = _run(layer, local(x), local(dy))
    what = f"tp{tp} ep{ps.ep_size} etp{ps.expt_tp_size} {dispatcher} grouped={grouped} capacity={capacity} rank {ps.rank}"
    assert_close(y, y_ref, **TOL, msg=lambda m: f"out {what}: {m}")
    assert_close(dx, dx_ref, **TOL, msg=lambda m: f"dx {what}: {m}")
    assert dw.keys() == dw_ref.keys()
    for name, grad in dw.items():
        grad = grad.clone()
        dist.all_reduce(grad, group=_reduce_group(name, ps))
        assert_close(grad, _shard(name, dw_ref[name], ps), **TOL, msg=lambda m, n=name: f"d{n} {what}: {m}")


def _init_is_layout_invariant(ps: ParallelState, tp: int) -> None:
    """The model's initialisation (``init_param_`` from the tags) gives each rank the slice of the
    one-rank layer's values."""
    cfg = dict(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)
    ref = MoELayer(moe_config(**cfg))
    layer = MoELayer(
        moe_config(sequence_parallel=tp > 1, **cfg),
        tp_group=ps.tp_group,
        sequence_parallel=tp > 1,
        moe_groups=MoEGroups.of(ps),
    )
    for (name, full), (_, mine) in zip(ref.named_parameters(), layer.named_parameters(), strict=True):
        init_param_(full, name, seed=3)
        init_param_(mine, name, seed=3, tp_rank=ps.tp_rank)
        assert_close(mine, _shard(name, full, ps), rtol=0, atol=0, msg=lambda m, n=name: f"init {n}: {m}")


def _all_layouts(ps0: ParallelState) -> None:
    weights = _logical(0)
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    for i, (tp, ep, etp) in enumerate(LAYOUTS):
        ps = build_parallel_state(tp=tp, ep=ep, etp=etp)
        _init_is_layout_invariant(ps, tp)
        for j, dispatcher in enumerate(("allgather", "alltoall")):
            _case(ps, tp, dispatcher, (i + j) % 2 == 1, None, weights, x, dy)
            if (tp, ep, etp) in CAPACITY_LAYOUTS:
                _case(ps, tp, dispatcher, (i + j) % 2 == 0, (0.5, j == 1), weights, x, dy)


def test_moe_layer_layouts_equal_one_rank() -> None:
    run_distributed(_all_layouts, world_size=4, timeout_s=300)
