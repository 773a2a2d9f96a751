"""The expert permutation: the sort-based row numbering, and the exact (dropless, all experts local)
gathers against the general permutation and combine, values and gradients."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.moe import permutation as pm
from megatron.core.transformer.moe import token_dispatcher as td
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig


def _topk_map(num_tokens: int, num_experts: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    top = logits.topk(k, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, -1))
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, top.indices, True)


def test_sort_rows_numbers_the_entries_expert_major_with_tokens_ascending_and_pads_the_rest() -> None:
    _, routing_map = _topk_map(13, 5, 2)
    routing_map[3] = False  # a token routed nowhere
    flat, valid = pm.sort_rows(routing_map, 30)
    expected = [e * 13 + t for e in range(5) for t in range(13) if routing_map[t, e]]
    assert flat[: len(expected)].tolist() == expected
    assert valid.tolist() == [True] * len(expected) + [False] * (30 - len(expected))
    # more rows than map entries: the padding rows point past the map
    flat, valid = pm.sort_rows(routing_map, 70)
    assert flat[65:].tolist() == [65] * 5 and not valid[len(expected) :].any()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_exact_permute_and_combine_equal_the_general_path_values_and_gradients(k: int) -> None:
    num_tokens, num_experts, h = 17, 6, 8
    probs, routing_map = _topk_map(num_tokens, num_experts, k, seed=k)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(num_tokens, h, generator=gen, dtype=torch.float32)
    weights = torch.randn(h, h, generator=gen, dtype=torch.float32)  # stands in for the experts
    grad = torch.randn(num_tokens, h, generator=gen, dtype=torch.float32)

    def run(exact: bool) -> tuple[torch.Tensor, ...]:
        x = tokens.clone().requires_grad_()
        p = probs.clone().requires_grad_()
        if exact:
            routing, counts = pm.ExactRouting.build(routing_map, k)
            rows = pm.permute_exact(x, routing)
            out = pm.combine_exact(torch.tanh(rows @ weights), routing.row_weights(p), routing)
        else:
            rows, perm, counts = td.permute_tokens(x, routing_map, num_tokens * k)
            out = td.unpermute_tokens(torch.tanh(rows @ weights), perm, p)
        out.backward(grad)
        return rows.detach(), counts, out.detach(), x.grad, p.grad

    for name, a, b in zip(("rows", "counts", "out", "d tokens", "d probs"), run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def _layer(exact: bool) -> MoELayer:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        activation="swiglu",
        add_bias_linear=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=True,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    assert layer.token_dispatcher.exact  # ep 1, dropless
    layer.token_dispatcher.exact = exact
    layer.experts.padded_rows = not exact
    return layer


def test_the_layer_gives_the_same_outputs_and_gradients_on_the_exact_and_the_general_path() -> None:
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for exact in (True, False):
        layer = _layer(exact)
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        results.append((out.detach(), xi.grad, grads))
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = results
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_a, dx_b, rtol=1e-5, atol=1e-6)
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_b[n], rtol=1e-5, atol=1e-6, msg=n)
