"""TopKRouter and moe_utils against hand-computed references on small batches (one process).

The router's weight is set to the identity with hidden = E, so its logits are the input itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.moe import moe_utils as mu
from megatron.core.transformer.moe.router import TopKRouter, aux_loss_names
from megatron.core.transformer.transformer_config import TransformerConfig

E = 4

# [T=4, E=4]: distinct values, so every top-k is unambiguous.
LOGITS = [
    [2.0, 1.0, 0.5, -1.0],
    [0.1, 0.3, 2.5, 0.2],
    [-0.5, 1.5, 1.2, 0.0],
    [0.7, -0.2, 0.4, 1.9],
]


def make_config(**moe: object) -> TransformerConfig:
    fields = {"num_moe_experts": E, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.0} | moe
    return TransformerConfig(num_layers=4, hidden_size=E, num_attention_heads=1, **fields)


def make_router(layer_number: int = 1, **moe: object) -> TopKRouter:
    router = TopKRouter(make_config(**moe), layer_number=layer_number)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


@pytest.fixture(autouse=True)
def _clean_tracker():
    mu.clear_aux_losses_tracker()
    mu.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
    mu.clear_aux_losses_tracker()
    mu.MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _softmax(v: list[float]) -> list[float]:
    m = max(v)
    e = [math.exp(a - m) for a in v]
    return [a / sum(e) for a in e]


def _top(v: list[float], k: int) -> list[int]:
    return sorted(range(len(v)), key=lambda i: -v[i])[:k]


def _dense(rows: list[dict[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.zeros(len(rows), E)
    for t, row in enumerate(rows):
        for i, p in row.items():
            probs[t, i] = p
    return probs, probs != 0


def _route(router: TopKRouter, logits: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    router.eval()
    with torch.no_grad():
        return router(torch.tensor(logits))


# -- probabilities ---------------------------------------------------------------------------------


def test_softmax_topk_then_softmax_over_the_chosen() -> None:
    rows = []
    for v in LOGITS:
        idx = _top(v, 2)
        rows.append(dict(zip(idx, _softmax([v[i] for i in idx]))))
    probs, routing_map = _route(make_router(), LOGITS)
    want_probs, want_map = _dense(rows)
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool
    assert torch.equal(routing_map, want_map)
    assert_close(probs, want_probs)


def test_pre_softmax_takes_the_top_k_of_the_full_softmax() -> None:
    rows = []
    for v in LOGITS:
        s = _softmax(v)
        rows.append({i: s[i] for i in _top(s, 2)})
    probs, routing_map = _route(make_router(moe_router_pre_softmax=True), LOGITS)
    assert_close(probs, _dense(rows)[0])
    assert torch.equal(routing_map, _dense(rows)[1])


@pytest.mark.parametrize("topk", [1, 2])
def test_sigmoid_normalises_the_chosen_scores_when_k_is_above_one(topk: int) -> None:
    rows = []
    for v in LOGITS:
        s = [1 / (1 + math.exp(-a)) for a in v]
        idx = _top(s, topk)
        total = sum(s[i] for i in idx) if topk > 1 else 1.0
        rows.append({i: s[i] / total for i in idx})
    probs, _ = _route(make_router(moe_router_score_function="sigmoid", moe_router_topk=topk), LOGITS)
    assert_close(probs, _dense(rows)[0])


def test_sqrtsoftplus_scores() -> None:
    rows = []
    for v in LOGITS:
        s = [math.sqrt(math.log1p(math.exp(a))) for a in v]
        idx = _top(s, 2)
        rows.append({i: s[i] / (s[idx[0]] + s[idx[1]]) for i in idx})
    probs, _ = _route(make_router(moe_router_score_function="sqrtsoftplus"), LOGITS)
    assert_close(probs, _dense(rows)[0])


def test_topk_scaling_factor_multiplies_the_weights() -> None:
    base, _ = _route(make_router(), LOGITS)
    scaled, routing_map = _route(make_router(moe_router_topk_scaling_factor=2.5), LOGITS)
    assert_close(scaled, base * 2.5)
    assert torch.equal(routing_map, base != 0)


def test_group_limited_topk_picks_within_the_best_groups() -> None:
    # Groups {0,1} and {2,3}; a group's score = the sum of its best topk / group_topk = 2 scores.
    rows = []
    for v in LOGITS:
        groups = [v[0] + v[1], v[2] + v[3]]
        g = 0 if groups[0] > groups[1] else 1
        idx = [2 * g, 2 * g + 1]
        rows.append(dict(zip(idx, _softmax([v[i] for i in idx]))))
    router = make_router(moe_router_num_groups=2, moe_router_group_topk=1)
    probs, routing_map = _route(router, LOGITS)
    assert torch.equal(routing_map, _dense(rows)[1])
    assert_close(probs, _dense(rows)[0])
    # Token 2 ([-0.5, 1.5, 1.2, 0.0]): plain top-2 would take experts 1 and 2 across the groups.
    assert routing_map[2].tolist() == [False, False, True, True]


def test_fp64_router_dtype_routes_in_fp64_and_returns_fp32() -> None:
    router = make_router(moe_router_dtype="fp64")
    assert router.gating(torch.tensor(LOGITS)).dtype == torch.float64
    probs, routing_map = _route(router, LOGITS)
    want, want_map = _route(make_router(), LOGITS)
    assert probs.dtype == torch.float32 and torch.equal(routing_map, want_map)
    assert_close(probs, want)


def test_bf16_weight_and_input_get_grads_in_their_dtypes() -> None:
    router = make_router()
    router.weight.data = router.weight.data.bfloat16()
    x = torch.tensor(LOGITS, dtype=torch.bfloat16, requires_grad=True)
    router.train()
    probs, _ = router(x)
    assert router.gating(x).dtype == torch.float32
    probs.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and router.weight.grad.dtype == torch.bfloat16


# -- auxiliary losses ------------------------------------------------------------------------------


def _aux_reference(logits: torch.Tensor, coeff: float, k: int = 2) -> torch.Tensor:
    """coeff * E * sum_i f_i * P_i, by hand: f_i from the top-k of the softmax over all experts."""
    scores = torch.softmax(logits, dim=-1)
    num_tokens = logits.shape[0]
    f = [0.0] * E
    for t in range(num_tokens):
        for i in _top(scores[t].tolist(), k):
            f[i] += 1.0 / (num_tokens * k)
    p = scores.mean(dim=0)
    return coeff * E * sum(f[i] * p[i] for i in range(E))


def _z_reference(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return coeff * torch.stack([torch.logsumexp(row, dim=0) ** 2 for row in logits]).mean()


def _router_grads(router: TopKRouter, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs and d(sum(probs * g) + scale * aux)/dx through the router."""
    x = x.clone().requires_grad_(True)
    router.train()
    probs, _ = router(x)
    (probs * g).sum().backward()
    return probs.detach(), x.grad


def _reference_grads(
    x: torch.Tensor, g: torch.Tensor, loss_fn, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with the routing math written out (softmax top-2) and the loss added explicitly."""
    x = x.clone().requires_grad_(True)
    top = x.topk(2, dim=-1)
    probs = torch.zeros_like(x).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    ((probs * g).sum() + scale * loss_fn(x)).backward()
    return probs.detach(), x.grad


def test_aux_loss_value_and_injected_gradient() -> None:
    coeff, scale = 0.1, 0.5
    x, g = torch.tensor(LOGITS), torch.randn(4, E, generator=torch.Generator().manual_seed(0))
    mu.MoEAuxLossAutoScaler.set_loss_scale(scale)
    probs, dx = _router_grads(make_router(moe_aux_loss_coeff=coeff), x, g)
    want_probs, want_dx = _reference_grads(x, g, lambda t: _aux_reference(t, coeff), scale)
    assert_close(probs, want_probs)
    assert_close(dx, want_dx)
    values = mu.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert_close(values[0], _aux_reference(x, 1.0))  # recorded without the coefficient
    assert values[1:].abs().sum() == 0


def test_aux_loss_gradient_is_not_zero() -> None:
    # The aux-loss term must move the gradient (else the test above compares nothing).
    x, g = torch.tensor(LOGITS), torch.zeros(4, E)
    _, dx = _router_grads(make_router(moe_aux_loss_coeff=1.0), x, g)
    assert dx.abs().max() > 1e-3


def test_z_loss_value_and_gradient() -> None:
    coeff, scale = 0.01, 2.0
    x, g = torch.tensor(LOGITS), torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
    _, dx = _router_grads(make_router(moe_z_loss_coeff=coeff), x, g)
    _, want_dx = _reference_grads(x, g, lambda t: _z_reference(t, coeff), scale)
    assert_close(dx, want_dx)
    assert_close(mu.get_moe_layer_wise_logging_tracker()["z_loss"]["values"][0], _z_reference(x, 1.0))


def test_seq_aux_loss_is_the_mean_over_sequences() -> None:
    coeff = 0.2
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, E, generator=gen)  # [s, b, h]
    g = torch.randn(6, E, generator=gen)
    router = make_router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=coeff)
    mu.MoEAuxLossAutoScaler.set_loss_scale(1.0)

    def loss(t: torch.Tensor) -> torch.Tensor:  # t [s * b, E], token = s_idx * b + b_idx
        seqs = t.view(3, 2, E)
        return sum(_aux_reference(seqs[:, j], coeff) for j in range(2)) / 2

    xr = x.clone().requires_grad_(True)
    router.train()
    probs, _ = router(xr)  # 3-D input: b = 2 sequences
    (probs * g).sum().backward()
    _, want_dx = _reference_grads(x.reshape(6, E), g, loss, 1.0)
    assert_close(xr.grad.reshape(6, E), want_dx)
    # A 2-D input with num_sequences is the same; without it the router asks for it.
    _, dx2 = _router_grads_2d(router, x.reshape(6, E), g, num_sequences=2)
    assert_close(dx2, want_dx)
    recorded = mu.get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"]["values"][0]
    assert_close(recorded, 2 * loss(x.reshape(6, E)) / coeff)  # two forwards recorded
    with pytest.raises(ValueError, match="num_sequences"):
        router(x.reshape(6, E))


def _router_grads_2d(router, x, g, num_sequences):
    x = x.clone().requires_grad_(True)
    probs, _ = router(x, num_sequences=num_sequences)
    (probs * g).sum().backward()
    return probs.detach(), x.grad


def test_global_aux_loss_averages_counts_over_micro_batches() -> None:
    coeff = 0.3
    gen = torch.Generator().manual_seed(3)
    micro = [torch.randn(5, E, generator=gen) for _ in range(2)]
    router = make_router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    mu.MoEAuxLossAutoScaler.set_loss_scale(1.0)
    counts = []
    for step, x in enumerate(micro):
        scores = torch.softmax(x, dim=-1)
        counts.append(torch.zeros(E).scatter_add(0, scores.topk(2).indices.flatten(), torch.ones(10)))
        mean_counts = sum(counts) / len(counts)

        def loss(t: torch.Tensor, mean_counts=mean_counts) -> torch.Tensor:
            # f_i from the running mean of the counts; P_i from this micro-batch's tokens.
            return coeff * E * (mean_counts / (5 * 2) * torch.softmax(t, dim=-1).mean(0)).sum()

        g = torch.randn(5, E, generator=gen)
        _, dx = _router_grads(router, x, g)
        _, want = _reference_grads(x, g, loss, 1.0)
        assert_close(dx, want)
        assert router.ga_steps.item() == step + 1
    entry = mu.get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]
    assert entry["needs_dp_avg"] is False
    mu.reset_global_aux_loss_tracker(router)
    assert router.ga_steps.item() == 0 and router.global_tokens_per_expert.abs().sum() == 0


def test_losses_need_training_and_grad() -> None:
    router = make_router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)
    x = torch.tensor(LOGITS, requires_grad=True)
    router.eval()
    probs, _ = router(x)
    assert probs.grad_fn is not None and "AutoScaler" not in type(probs.grad_fn).__name__
    router.train()
    with torch.no_grad():
        router(x)
    assert all(e["values"].abs().sum() == 0 for e in mu.get_moe_layer_wise_logging_tracker().values())
    # A graph-less training pass waits for a recompute to record it, within the step only.
    assert router._unrecorded_passes == 1
    mu.clear_aux_losses_tracker()
    assert router._unrecorded_passes == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_records_once_and_gives_the_same_gradient(reentrant: bool) -> None:
    # Non-reentrant: the first pass records, the recompute (inside backward) does not. Reentrant:
    # the first pass runs without a graph (no losses), the recompute attaches and records them.
    router = make_router(
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.1,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    router.train()
    x, g = torch.tensor(LOGITS), torch.randn(4, E, generator=torch.Generator().manual_seed(4))
    _, want_dx = _router_grads(router, x, g)
    want = {k: e["values"].clone() for k, e in mu.get_moe_layer_wise_logging_tracker().items()}
    want_stats = {k: e["values"].clone() for k, e in mu.get_moe_stats_tracker().items()}
    want_counts = router.local_tokens_per_expert.clone()
    mu.clear_aux_losses_tracker()
    router.local_tokens_per_expert.zero_()
    xr = x.clone().requires_grad_(True)
    out = torch.utils.checkpoint.checkpoint(lambda t: router(t)[0], xr, use_reentrant=reentrant)
    (out * g).sum().backward()
    assert_close(xr.grad, want_dx)
    assert want["load_balancing_loss"][0] > 0 and want["z_loss"][0] > 0
    for k, e in mu.get_moe_layer_wise_logging_tracker().items():
        assert_close(e["values"], want[k])
    for k, e in mu.get_moe_stats_tracker().items():
        assert_close(e["values"], want_stats[k])
    assert_close(router.local_tokens_per_expert, want_counts)


# -- tracker ---------------------------------------------------------------------------------------


def test_track_moe_metrics_averages_over_moe_layers_and_clears() -> None:
    coeff = 0.1
    routers = [make_router(layer_number=n, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=0.01) for n in (1, 3)]
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, E, generator=gen) for _ in range(2)]  # two micro-batches
    for r in routers:
        r.train()
        for x in xs:
            r(x.clone().requires_grad_(True))
    aux = [_aux_reference(x, 1.0) for x in xs]
    z = [_z_reference(x, 1.0) for x in xs]
    total: dict[str, float] = {}
    out = mu.track_moe_metrics(
        0.5, num_layers=4, moe_layer_freq=[1, 0, 1, 0], per_layer_logging=True, total_loss_dict=total
    )
    # Two routers on the same tokens; loss_scale 1/2 averages the micro-batches.
    assert out["load_balancing_loss"] == pytest.approx(float(sum(aux)) / 2, rel=1e-5)
    assert out["z_loss"] == pytest.approx(float(sum(z)) / 2, rel=1e-5)
    assert out["moe/load_balancing_loss_layer_2"] == pytest.approx(float(sum(aux)) / 2, rel=1e-5)
    assert "moe/load_balancing_loss_layer_1" not in out
    assert total["load_balancing_loss"] == out["load_balancing_loss"]
    assert out["dropped_token_fraction"] == 0.0
    counts = torch.zeros(E)
    for x in xs:
        counts += torch.zeros(E).scatter_add(0, x.topk(2).indices.flatten(), torch.ones(12))
    assert out["expert_load_imbalance"] == pytest.approx(float(counts.max() / counts.mean()))
    for j in range(E):
        assert out[f"moe/tokens_per_expert_layer_0/expert_{j}"] == counts[j].item()
    for table in (mu.get_moe_layer_wise_logging_tracker(), mu.get_moe_stats_tracker()):
        assert all(e["values"].abs().sum() == 0 for e in table.values())


def test_tracker_reuses_storage_across_steps() -> None:
    router = make_router(moe_aux_loss_coeff=0.1)
    router.train()
    router(torch.tensor(LOGITS, requires_grad=True))
    storage = mu.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].data_ptr()
    mu.track_moe_metrics(1.0, num_layers=4)
    router(torch.tensor(LOGITS, requires_grad=True))
    assert mu.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].data_ptr() == storage
    assert not mu.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].requires_grad


def test_force_initialize_creates_entries_for_a_stage_without_moe_layers() -> None:
    out = mu.track_moe_metrics(
        1.0, force_initialize=True, track_names=["load_balancing_loss"], num_layers=4, num_experts=E
    )
    assert out == {"load_balancing_loss": 0.0}
    assert mu.get_moe_stats_tracker()["tokens_per_expert"]["values"].shape == (4, E)


# -- expert bias -----------------------------------------------------------------------------------


def test_expert_bias_changes_the_choice_not_the_weights() -> None:
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    plain, plain_map = _route(router, LOGITS)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    probs, routing_map = _route(router, LOGITS)
    assert routing_map[:, 3].all() and not torch.equal(routing_map, plain_map)
    for t, v in enumerate(LOGITS):
        s = [1 / (1 + math.exp(-a)) for a in v]
        other = _top(s[:3], 1)[0]  # expert 3 is forced; the other is the best unbiased score
        want = {3: s[3] / (s[3] + s[other]), other: s[other] / (s[3] + s[other])}
        assert_close(probs[t], _dense([want])[0][0])


def test_expert_bias_update_follows_the_sign_rule() -> None:
    router = make_router(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
    )
    router.train()
    x = torch.tensor(LOGITS, requires_grad=True)
    router(x)
    _, routing_map = router(x)
    counts = routing_map.sum(0).float() * 2  # two forwards
    assert_close(router.local_tokens_per_expert, counts)
    start = torch.tensor([0.1, -0.2, 0.0, 0.3])
    router.expert_bias.copy_(start)
    mu.update_expert_bias([router], None)
    mean = counts.mean()
    want = [start[i] + 0.01 * (1 if counts[i] < mean else -1 if counts[i] > mean else 0) for i in range(E)]
    assert_close(router.expert_bias, torch.stack(want))
    assert router.local_tokens_per_expert.abs().sum() == 0
    assert counts.unique().numel() > 1  # the rule moved some experts up and some down
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()


def test_expert_bias_is_not_counted_in_eval() -> None:
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    _route(router, LOGITS)
    assert router.local_tokens_per_expert.abs().sum() == 0


# -- capacity --------------------------------------------------------------------------------------

# k = 1, T = 6, E = 4, factor 1: capacity = ceil(6 * 1 / 4) = 2. Expert 0 is chosen by tokens 0, 1,
# 3, 5 (softmax over one logit: prob 1 for k = 1, so the probs policy keys on the sigmoid score).
CAP_LOGITS = [
    [1.0, 0.0, 0.0, 0.0],  # -> 0
    [3.0, 0.0, 0.0, 0.0],  # -> 0
    [0.0, 2.0, 0.0, 0.0],  # -> 1
    [2.0, 0.0, 0.0, 0.0],  # -> 0
    [0.0, 0.0, 1.0, 0.0],  # -> 2
    [4.0, 0.0, 0.0, 0.0],  # -> 0
]


def _cap_router(policy: str, pad: bool = False, factor: float = 1.0) -> TopKRouter:
    return make_router(
        moe_router_topk=1,
        moe_router_score_function="sigmoid",
        moe_expert_capacity_factor=factor,
        moe_token_drop_policy=policy,
        moe_pad_expert_input_to_capacity=pad,
    )


def _column(routing_map: torch.Tensor, e: int) -> list[int]:
    return routing_map[:, e].nonzero().flatten().tolist()


def test_capacity_drops_lowest_probability_tokens() -> None:
    probs, routing_map = _route(_cap_router("probs"), CAP_LOGITS)
    assert _column(routing_map, 0) == [1, 5]  # scores 3 and 4 kept; 1 and 2 dropped
    assert _column(routing_map, 1) == [2] and _column(routing_map, 2) == [4] and _column(routing_map, 3) == []
    assert probs[0].abs().sum() == 0 and probs[3].abs().sum() == 0
    assert probs[5, 0] == pytest.approx(1 / (1 + math.exp(-4.0)))


def test_capacity_drops_by_position() -> None:
    probs, routing_map = _route(_cap_router("position"), CAP_LOGITS)
    assert _column(routing_map, 0) == [0, 1]  # the first two routed tokens
    assert probs[3].abs().sum() == 0 and probs[5].abs().sum() == 0


@pytest.mark.parametrize("policy,kept0", [("probs", [1, 5]), ("position", [0, 1])])
def test_pad_to_capacity_gives_every_expert_exactly_capacity_slots(policy: str, kept0: list[int]) -> None:
    probs, routing_map = _route(_cap_router(policy, pad=True), CAP_LOGITS)
    assert routing_map.sum(0).tolist() == [2, 2, 2, 2]
    assert _column(routing_map, 0) == kept0
    # Padding: the earliest tokens not routed to the expert, with probability 0.
    assert _column(routing_map, 1) == [0, 2] and _column(routing_map, 3) == [0, 1]
    assert probs[0, 1] == 0 and probs[2, 1] > 0 and probs[:, 3].abs().sum() == 0


def test_capacity_above_the_token_count_drops_nothing() -> None:
    base, base_map = _route(make_router(moe_router_topk=1, moe_router_score_function="sigmoid"), CAP_LOGITS)
    probs, routing_map = _route(_cap_router("probs", factor=8.0), CAP_LOGITS)
    assert torch.equal(routing_map, base_map) and torch.equal(probs, base)
    _, padded = _route(_cap_router("probs", pad=True, factor=8.0), CAP_LOGITS)
    assert padded.all()  # capacity >= T: every token in every expert's slots


def test_apply_capacity_with_top2_softmax_probs() -> None:
    # Pure function: T = 4, k = 2, E = 4, factor 0.5: capacity = ceil(4 * 2 / 4 * 0.5) = 1.
    probs, routing_map = mu.topk_routing_with_score_function(torch.tensor(LOGITS), 2)
    kept_probs, kept_map = mu.apply_capacity(probs, routing_map, 2, 0.5, "probs")
    for e in range(E):
        col = probs[:, e]
        if (col > 0).any():
            assert _column(kept_map, e) == [int(col.argmax())]
    assert torch.equal(kept_probs, probs * kept_map)


def test_dropped_fraction_is_logged() -> None:
    router = _cap_router("probs")
    router.train()
    router(torch.tensor(CAP_LOGITS, requires_grad=True))
    out = mu.track_moe_metrics(1.0, num_layers=4)
    assert out["dropped_token_fraction"] == pytest.approx(2 / 6)
    assert out["expert_load_imbalance"] == pytest.approx(2 / 1)  # kept counts [2, 1, 1, 0]


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type"),
        ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
        ({"moe_router_topk": 5}, "moe_router_topk"),
        ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "moe_router_num_groups"),
        ({"moe_router_num_groups": 2}, "moe_router_group_topk"),
        ({"moe_pad_expert_input_to_capacity": True}, "moe_expert_capacity_factor"),
        ({"moe_token_drop_policy": "random"}, "moe_token_drop_policy"),
        ({"moe_router_dtype": "bf16"}, "moe_router_dtype"),
    ],
)
def test_router_config_errors_name_the_field(fields: dict, param: str) -> None:
    # The router checks its own fields (a config built without TransformerConfig's validation).
    cfg = make_config()
    for k, v in fields.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError) as err:
        TopKRouter(cfg)
    assert param in err.value.params and param in str(err.value)


def test_router_parameter_tags() -> None:
    router = TopKRouter(make_config())
    assert router.weight.shape == (E, E) and router.weight.init_std == router.config.init_method_std
    assert not router.weight.sequence_parallel and getattr(router.weight, "allreduce", True)
    assert router.expert_bias is None and list(dict(router.named_buffers())) == []


def test_expert_bias_stays_fp32_after_a_model_cast() -> None:
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router.to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.bfloat16
    router.train()
    router(torch.tensor(LOGITS, dtype=torch.bfloat16, requires_grad=True))
    assert router.expert_bias.dtype == torch.float32 and router.local_tokens_per_expert.dtype == torch.float32
    assert "expert_bias" in dict(router.named_buffers())


def test_per_token_loss_scales_the_injected_loss_by_the_tokens() -> None:
    x, g = torch.tensor(LOGITS), torch.zeros(4, E)
    _, dx = _router_grads(make_router(moe_aux_loss_coeff=0.1), x, g)
    _, dx_tok = _router_grads(make_router(moe_aux_loss_coeff=0.1, calculate_per_token_loss=True), x, g)
    assert_close(dx_tok, dx * 4)  # T = 4 tokens on this one rank


def test_reset_buffers_after_materialising_a_meta_router() -> None:
    cfg = make_config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=0.1,
    )
    with torch.device("meta"):
        router = TopKRouter(cfg)
    router.to_empty(device="cpu")
    router.reset_buffers_()
    for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
        buf = getattr(router, name)
        assert buf.device.type == "cpu" and buf.dtype == torch.float32 and buf.abs().sum() == 0


def test_metrics_report_only_what_this_step_recorded() -> None:
    # A loss recorded in an earlier step (and a model with another layer count) is not reported.
    TopKRouter(make_config(moe_aux_loss_coeff=0.1)).train()(torch.tensor(LOGITS, requires_grad=True))
    mu.track_moe_metrics(1.0)
    cfg = make_config(moe_z_loss_coeff=0.1)
    cfg.num_layers = 2
    router = TopKRouter(cfg, layer_number=2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    router.train()
    router(torch.tensor(LOGITS, requires_grad=True))
    out = mu.track_moe_metrics(1.0)
    assert "load_balancing_loss" not in out
    assert out["z_loss"] == pytest.approx(float(_z_reference(torch.tensor(LOGITS), 1.0)) / 2)


def test_aux_loss_names_are_what_the_router_records() -> None:
    cfg = make_config(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.0, 0.2],
        moe_z_loss_coeff=0.01,
    )
    names = aux_loss_names(cfg)
    assert names == ["load_balancing_loss", "global_load_balancing_loss", "z_loss"]
    router = TopKRouter(cfg)
    router.train()
    router(torch.randn(3, 2, E, requires_grad=True))
    assert sorted(
        n for n, e in mu.get_moe_layer_wise_logging_tracker().items() if e["values"].any()
    ) == sorted(names)
