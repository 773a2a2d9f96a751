"""The MoE layer on one rank: grouped GEMM equals the loop; the layer (both dispatchers, shared
experts, capacity dropping, padding to capacity) equals a hand-written per-token reference
``sum_k prob_k * expert_k(x)``, forward and gradients."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.testing import assert_close

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.moe.expert_params import is_expert_param
from megatron.core.transformer.moe.experts import GroupedExperts, grouped_gemm_applies
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.moe.moe_layer import MoELayer, check_moe_layer_config
from megatron.core.transformer.moe.token_dispatcher import permute_tokens, unpermute_tokens
from megatron.core.transformer.transformer_config import TransformerConfig

H, FFN, E = 8, 16, 4


def moe_config(**overrides: object) -> SimpleNamespace:
    """A TransformerConfig's defaults as a namespace (no checks run), with a tiny MoE model."""
    base = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.default is not dataclasses.MISSING:
            base[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            base[f.name] = f.default_factory()
    base.update(
        num_layers=2,
        hidden_size=H,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=FFN,
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


def fill_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


def _expert(x: torch.Tensor, w1, b1, w2, b2, act) -> torch.Tensor:
    return F.linear(act(F.linear(x, w1, b1)), w2, b2)


def _activation(config):
    if config.activation == "swiglu":
        return lambda y: F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1]
    return F.gelu


def reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Per token: sum over its routed experts of prob * expert(x), plus the shared expert."""
    cfg = layer.config
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    probs, routing_map = layer.router(x)
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    act = _activation(cfg)
    out = []
    for t in range(tokens.shape[0]):
        acc = tokens.new_zeros(h)
        for e in range(cfg.num_moe_experts):
            if routing_map[t, e]:
                b1 = None if fc1.bias is None else fc1.bias[e]
                b2 = None if fc2.bias is None else fc2.bias[e]
                acc = acc + probs[t, e] * _expert(tokens[t], fc1.weight[e], b1, fc2.weight[e], b2, act)
        out.append(acc)
    result = torch.stack(out).view(s, b, h)
    se = layer.shared_experts
    if se is not None:
        y = _expert(
            x, se.linear_fc1.weight, se.linear_fc1.bias, se.linear_fc2.weight, se.linear_fc2.bias, act
        )
        if se.gate_weight is not None:
            y = y * torch.sigmoid(x @ se.gate_weight.T)
        result = result + y
    return result


def _grads(module: torch.nn.Module, x: torch.Tensor, fn, dy: torch.Tensor):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


CASES = {
    "allgather": dict(moe_token_dispatcher_type="allgather"),
    "alltoall": dict(moe_token_dispatcher_type="alltoall"),
    "gelu_bias": dict(activation="gelu", add_bias_linear=True),
    "shared_gate": dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
    "capacity_a2a": dict(moe_expert_capacity_factor=0.5, moe_token_dispatcher_type="alltoall"),
    "capacity_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "pad_to_capacity": dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True),
    "grouped_gemm_a2a": dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall"),
    "grouped_gemm_topk1": dict(moe_grouped_gemm=True, moe_router_topk=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equals_per_token_reference(case: str) -> None:
    cfg = moe_config(**CASES[case])
    layer = MoELayer(cfg)
    fill_(layer, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, H, generator=gen)
    dy = torch.randn(6, 2, H, generator=gen)
    y, dx, dw = _grads(layer, x, lambda t: layer(t)[0], dy)
    y_ref, dx_ref, dw_ref = _grads(layer, x, lambda t: reference(layer, t), dy)
    assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    assert dw.keys() == dw_ref.keys()
    for name in dw:
        assert_close(dw[name], dw_ref[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    _, routing_map = layer.router(x)
    if cfg.moe_expert_capacity_factor is not None and not cfg.moe_pad_expert_input_to_capacity:
        assert routing_map.sum() < routing_map.shape[0] * cfg.moe_router_topk  # tokens were dropped


def test_state_dict_names_and_tags() -> None:
    layer = MoELayer(moe_config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True))
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "router.weight": (E, H),
        "experts.linear_fc1.weight": (E, 2 * FFN, H),
        "experts.linear_fc2.weight": (E, H, FFN),
        "shared_experts.gate_weight": (1, H),
        "shared_experts.linear_fc1.weight": (24, H),
        "shared_experts.linear_fc2.weight": (H, 12),
    }
    fc1 = layer.experts.linear_fc1.weight
    assert is_expert_param(fc1) and fc1.partition_dim == 1 and fc1.partition_stride == 2
    assert layer.experts.linear_fc2.weight.partition_dim == 2
    assert not is_expert_param(layer.router.weight)
    assert not is_expert_param(layer.shared_experts.linear_fc1.weight)
    layer.set_layer_number(2)
    assert layer.layer_number == layer.router.layer_number == 2


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("gelu", True)])
def test_grouped_gemm_equals_loop(activation: str, bias: bool) -> None:
    cfg = moe_config(activation=activation, add_bias_linear=bias)
    loop = GroupedExperts(E, cfg)
    grouped = GroupedExperts(
        E, moe_config(activation=activation, add_bias_linear=bias, moe_grouped_gemm=True)
    )
    fill_(loop, 3)
    grouped.load_state_dict(loop.state_dict())
    counts = [3, 0, 5, 2]
    n, m = sum(counts), sum(counts) + 4  # 4 padding rows
    gen = torch.Generator().manual_seed(4)
    x, dy = torch.randn(m, H, generator=gen), torch.randn(m, H, generator=gen)
    x[n:], dy[n:] = float("nan"), 0  # padding rows hold anything; nothing of them may leak
    if not grouped_gemm_applies(True, x, (grouped.linear_fc1.weight, grouped.linear_fc2.weight)):
        pytest.skip("torch._grouped_mm does not run on this device/dtype")
    assert not grouped_gemm_applies(False, x, (grouped.linear_fc1.weight,))
    results = []
    for experts, tpe in ((loop, counts), (grouped, torch.tensor(counts))):
        y, dx, dw = _grads(experts, x, lambda t, e=experts, c=tpe: e(t, c), dy)
        results.append((y[:n], dx[:n], dw))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for name in dw0:
        assert_close(dw1[name], dw0[name], rtol=1e-5, atol=1e-6, msg=lambda m_, n_=name: f"{n_}: {m_}")


def test_permute_groups_rows_by_expert() -> None:
    routing_map = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    tokens = torch.arange(4.0).unsqueeze(1).repeat(1, 2)  # row t holds t
    rows, perm, counts = permute_tokens(tokens, routing_map, num_rows=7)
    assert counts.tolist() == [2, 1, 2]
    assert rows[:, 0].tolist() == [0, 2, 2, 0, 1, 0, 0]  # experts 0: t0 t2; 1: t2; 2: t0 t1; 2 pads
    probs = torch.tensor([[0.5, 0, 0.25], [0, 0, 1.0], [0.1, 0.2, 0], [0, 0, 0]])
    back = unpermute_tokens(rows + 1, perm, probs)  # padding rows (value 1) add nothing
    assert_close(back[:, 0], torch.tensor([0.75 * 1, 1.0 * 2, 0.3 * 3, 0.0]))


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="sequence_parallel"):
        check_moe_layer_config(moe_config(), MoEGroups(), tp_size=2, sequence_parallel=False)
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type"):
        MoELayer(moe_config(moe_token_dispatcher_type="flex"))
    with pytest.raises(ConfigError, match="fp8"):
        MoELayer(moe_config(fp8="e4m3"))
    with pytest.raises(ConfigError, match="moe_apply_probs_on_input"):
        MoELayer(moe_config(moe_apply_probs_on_input=True))
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size"):
        GroupedExperts(E, moe_config(moe_ffn_hidden_size=15), _groups_stub(etp=2))


def _groups_stub(etp: int) -> SimpleNamespace:
    return SimpleNamespace(etp_size=etp, etp_rank=0, ep_rank=0, ep_size=1)


@pytest.mark.parametrize("dispatcher, grouped", [("allgather", True), ("alltoall", False)])
def test_bf16_layer_close_to_fp32(dispatcher: str, grouped: bool) -> None:
    """bf16 parameters and activations: the output keeps the input's dtype and stays within bf16
    rounding of the fp32 layer with the same weights (routing is the same on these tokens)."""
    overrides = dict(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    layer32 = MoELayer(moe_config(**overrides))
    fill_(layer32, 5)
    with torch.no_grad():
        for p in layer32.parameters():  # weights that bf16 holds exactly
            p.copy_(p.bfloat16().float())
    layer16 = MoELayer(moe_config(params_dtype=torch.bfloat16, **overrides))
    layer16.load_state_dict({k: v.bfloat16() for k, v in layer32.state_dict().items()})
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    y16, _ = layer16(x)
    y32, _ = layer32(x.float())
    assert y16.dtype == torch.bfloat16
    _, map16 = layer16.router(x)
    _, map32 = layer32.router(x.float())
    assert torch.equal(map16, map32)
    assert_close(y16.float(), y32, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_layer_gives_the_same_gradients(dispatcher: str, reentrant: bool) -> None:
    """The whole layer under activation checkpointing (``--recompute-modules moe``)."""
    layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, moe_shared_expert_intermediate_size=12))
    fill_(layer, 7)
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(6, 2, H, generator=gen), torch.randn(6, 2, H, generator=gen)
    plain = _grads(layer, x, lambda t: layer(t)[0], dy)
    recomputed = _grads(
        layer,
        x,
        lambda t: torch.utils.checkpoint.checkpoint(lambda u: layer(u)[0], t, use_reentrant=reentrant),
        dy,
    )
    assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    assert_close(recomputed[1], plain[1], rtol=0, atol=0)
    for name in plain[2]:
        assert_close(recomputed[2][name], plain[2][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_selective_recompute_of_moe_layers_runs_the_layer_again_in_backward() -> None:
    """``recompute_granularity="selective"`` with ``"moe"`` in ``recompute_modules``: the layer keeps
    only its input and runs again in backward (the router twice per step), with the same gradients."""
    cfg = dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12)
    plain_layer = MoELayer(moe_config(**cfg))
    layer = MoELayer(moe_config(**cfg, recompute_granularity="selective", recompute_modules=["moe"]))
    fill_(plain_layer, 7)
    layer.load_state_dict(plain_layer.state_dict())
    calls = []
    layer.router.register_forward_hook(lambda *_: calls.append(1))
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(6, 2, H, generator=gen), torch.randn(6, 2, H, generator=gen)
    plain = _grads(plain_layer, x, lambda t: plain_layer(t)[0], dy)
    recomputed = _grads(layer, x, lambda t: layer(t)[0], dy)
    assert len(calls) == 2  # forward, then the recompute in backward
    for a, b in zip(recomputed[:2], plain[:2]):
        assert_close(a, b, rtol=0, atol=0)
    for name in plain[2]:
        assert_close(recomputed[2][name], plain[2][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    layer.eval()
    calls.clear()
    layer(x)
    assert len(calls) == 1  # evaluation keeps no graph to recompute
