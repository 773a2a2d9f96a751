"""Routing functions, auxiliary losses, capacity, the aux-loss autoscaler and expert-bias updates;
the metric tracker (``moe_logging``) under its ``moe_utils`` names.

Shapes: ``T`` tokens of this rank, ``E`` experts, ``k`` = top-k. A routing map ``[T, E]`` is True
where a token goes to an expert; routing probabilities ``[T, E]`` are the combine weights, 0 off the
map. Megatron-Core's names and conventions (``megatron/core/transformer/moe/moe_utils.py``).

Auxiliary losses over several ranks: the ranks of a statistics group (tp x cp: slices of the same
sequences) each compute their *share* of the group's loss from the group's token counts and their
own tokens' probabilities; the shares sum to the loss of all the group's tokens, and each token's
gradient is that loss's gradient. The tracker sums the shares over the group when it logs them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size

# The tracker lives in moe_logging; these are its Megatron-Core moe_utils names.
from megatron.core.transformer.moe.moe_logging import (  # noqa: F401
    AUX_LOSS_NAMES,
    ROUTERS,
    STAT_NAMES,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    get_moe_stats_tracker,
    in_backward,
    num_moe_layers,
    reduce_aux_losses_tracker_across_ranks,
    save_to_aux_losses_tracker,
    save_to_moe_stats_tracker,
    track_moe_metrics,
)

# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """This rank's share of the Switch / GShard load-balancing loss ``coeff * E * sum_i f_i * P_i``.

    ``f_i = N_i / (T * k)`` with ``N_i = tokens_per_expert[i]`` the tokens routed to ``i`` and ``T =
    total_num_tokens``, both counted over the statistics group; ``P_i = sum_x probs[x, i] / T`` where
    this rank contributes its own tokens ``x``. With one rank the share is the loss.

    Args:
        probs: ``[T_local, E]`` router scores (softmax over all experts, or the normalised sigmoid).
        tokens_per_expert: ``[E]`` token counts over the group.
        total_num_tokens: the group's token count ``T``.
    """
    counts = tokens_per_expert.to(probs.dtype)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(probs.sum(dim=0) * counts) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss ``coeff * mean_x(logsumexp(logits[x])^2)`` over ``logits`` ``[T, E]``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward also sends ``main_loss_backward_scale`` as the gradient of
    ``aux_loss``, so the aux loss is minimised as if ``scale * aux_loss`` were added to the loss.

    The schedule sets the scale to the main loss's backward scale: ``1 / num_microbatches`` (times
    the fp16 loss scale), or 1 with per-token loss (Megatron's rule)."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            return grad_output, torch.ones_like(aux_loss)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor | float) -> None:
        """The gradient the aux losses receive (a scalar; the main loss's backward scale)."""
        value = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())
        MoEAuxLossAutoScaler.main_loss_backward_scale = value


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to ``group_topk`` of ``num_groups`` equal groups of consecutive experts.

    A group's score is the sum of its best ``topk // group_topk`` scores; the ``group_topk`` best
    groups are kept and the top-k taken over their experts (DeepSeek's device / node-limited routing).

    Returns:
        ``(values, indices)``, each ``[T, topk]``.
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1)


def _topk(
    scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        assert num_groups is not None
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=-1)


def _activation(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise ValueError(f"invalid score_function {score_function!r}")


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts and their weights from ``logits`` ``[T, E]``.

    * softmax: top-k of the logits, softmax over the k chosen; with ``use_pre_softmax`` softmax
      over all E experts, then their top-k values (not renormalised).
    * sigmoid / sqrtsoftplus: scores = f(logits); the choice is the top-k of ``scores +
      expert_bias`` (the bias only chooses), the weights are the chosen scores divided by their sum
      when k > 1.
    * group-limited top-k (``num_groups`` / ``group_topk``) restricts the choice; ``scaling_factor``
      multiplies the weights.

    Returns:
        ``(probs [T, E], routing_map [T, E] bool)``: probs in ``logits``' dtype, 0 off the map.
    """
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, top_indices = _topk(scores, topk, num_groups, group_topk)
        else:
            top_logits, top_indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = _activation(logits, score_function)
        if expert_bias is not None:
            _, top_indices = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)
            probs = torch.gather(scores, 1, top_indices)
        else:
            probs, top_indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics the load-balancing losses read: ``(routing_map [T, E], scores [T, E])``.

    ``scores`` is the softmax over all experts (sigmoid / sqrtsoftplus scores divided by their sum
    over all experts); ``routing_map`` its plain top-k (no expert bias, group limit or capacity), as
    Megatron-Core computes ``f_i``."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = _activation(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_indices = torch.topk(scores, k=topk, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)``; ``num_tokens`` counts
    token-expert pairs (``T * k``)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity = ceil(T * k / E * capacity_factor)`` tokens per expert.

    Each expert keeps its routed tokens of highest probability (``drop_policy="probs"``) or its
    first routed tokens in token order (``"position"``); ties go to the earlier token. With
    ``pad_to_capacity`` every expert's column holds exactly ``min(capacity, T)`` True entries: the
    kept tokens, then unrouted tokens in token order as padding (probability 0).

    Returns:
        ``(probs, routing_map)`` after dropping (and padding), ``[T, E]`` each.
    """
    num_tokens, num_experts = routing_probs.shape
    capacity = min(get_capacity(num_tokens * router_topk, num_experts, capacity_factor), num_tokens)
    if drop_policy == "probs":
        # Routed tokens rank by probability (> 0 for every score function); unrouted ones after.
        key = torch.where(routing_map, routing_probs, torch.full_like(routing_probs, -1.0))
    elif drop_policy == "position":
        key = routing_map.float()
    else:
        raise ValueError(f"invalid drop_policy {drop_policy!r}; choose 'probs' or 'position'")
    # Stable descending sort along tokens: equal keys keep token order.
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]  # [C, E]
    capacity_mask = torch.zeros_like(routing_map).scatter(0, order, True)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * (routing_map & capacity_mask), final_map


apply_capacity = apply_router_token_dropping


# ---------------------------------------------------------------------------------------------
# Aux-loss-free balancing
# ---------------------------------------------------------------------------------------------


def _routers_with_bias(model_chunks_or_routers: Any) -> list[Any]:
    items = model_chunks_or_routers
    if isinstance(items, torch.nn.Module):
        items = [items]
    found: list[Any] = []
    for item in items:
        for m in item.modules():
            if (
                getattr(m, "expert_bias", None) is not None
                and getattr(m, "local_tokens_per_expert", None) is not None
            ):
                found.append(m)
    return found


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, expert_bias_update_rate: float
) -> torch.Tensor:
    """``bias + rate * sign(mean(counts) - counts)`` over the last dim (Megatron-Core's rule,
    arXiv:2408.15664): under-loaded experts move up, over-loaded down, balanced ones stay."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(mean - tokens_per_expert) * expert_bias_update_rate


@torch.no_grad()
def update_expert_bias(
    model_chunks_or_routers: Any, rate: float | None = None, group: ProcessGroup | None = None
) -> None:
    """After the optimizer step: move every router's ``expert_bias`` by the rule of
    ``get_updated_expert_bias`` using its ``local_tokens_per_expert`` summed over ``group`` (tp x dp
    x cp: every rank of the stage; default each router's ``groups.tp_dp_cp``), then zero the counts.

    Args:
        model_chunks_or_routers: modules (or a list of them) searched for routers with a bias.
        rate: the update rate; default each router's ``config.moe_router_bias_update_rate``.
    """
    routers = _routers_with_bias(model_chunks_or_routers)
    if not routers:
        return
    for r in routers:
        r.keep_fp32_buffers()
    if group is None:
        group = getattr(getattr(routers[0], "groups", None), "tp_dp_cp", None)
    counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])  # [R, E]
    if group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for r, c in zip(routers, counts):
        r_rate = r.config.moe_router_bias_update_rate if rate is None else rate
        r.expert_bias.copy_(get_updated_expert_bias(c, r.expert_bias.float(), r_rate))
        r.local_tokens_per_expert.zero_()


def reset_global_aux_loss_tracker(model_chunks_or_routers: Any) -> None:
    """Zero the routers' global-batch token counts (``global_aux_loss``); call once per step."""
    items = model_chunks_or_routers
    for item in [items] if isinstance(items, torch.nn.Module) else items:
        for m in item.modules():
            reset: Any = getattr(m, "reset_global_aux_loss_tracker", None)
            if reset is not None:
                reset()
