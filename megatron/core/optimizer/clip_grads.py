"""Gradient statistics over fp32 main grads (norm, zeros, overflow), without per-tensor host syncs.

Clipping itself is applied by the optimizer step from a device-side divisor (:func:`step_with_divisor`).

Every function here returns device tensors; the caller packs them into one buffer and reduces it
once over the grad-stats group; nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def param_is_not_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """True when ``param``'s gradient should count in global statistics (norm, zeros).

    A param is a duplicate when it is the shared copy of a tied embedding held by another pipeline
    stage (``shared_embedding_copy``), or when it is replicated across tensor-parallel ranks (not
    ``tensor_model_parallel``) and this is not TP rank 0. An expert parameter (``moe.expert_params``)
    lives in the expert grid, whose model-parallel ranks (expert-tp x ep x pp) each hold a distinct
    shard: it is a duplicate only when not split over expert-tp and this is not expert-tp rank 0
    (its copies over expert-dp are for the caller to count once: :func:`counts_in_stats`).
    """
    if getattr(param, "shared_embedding_copy", False):
        return False
    rank = param.etp_rank if getattr(param, "expert_parallel", False) else tp_rank  # type: ignore[attr-defined]
    return bool(getattr(param, "tensor_model_parallel", False)) or rank == 0


def counts_in_stats(param: torch.nn.Parameter, tp_rank: int, replica_ranks: tuple[int, int] = (0, 0)) -> bool:
    """Whether ``param``'s gradient counts in statistics summed over a group that spans its
    data-parallel replicas too: :func:`param_is_not_duplicate`, and this rank the first replica
    (``replica_ranks`` = (dp x cp rank, expert-dp rank): dense params count where the first is 0,
    expert params where the second is). ``(0, 0)``: each element is held once (a sharded optimizer
    or FSDP), or the group spans no replicas (tp x pp)."""
    expert = getattr(param, "expert_parallel", False)
    return param_is_not_duplicate(param, tp_rank) and replica_ranks[1 if expert else 0] == 0


def grad_norm_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ‖g‖² over ``grads`` as a 0-dim fp32 tensor on ``device`` (no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # one fp32 norm per tensor, any grad dtype
    return torch.stack(norms).float().pow(2).sum()


def count_zeros(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Number of exactly-zero gradient elements, as a 0-dim fp32 tensor (no host sync)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total = total + (g.numel() - torch.count_nonzero(g))
    return total


def unscale_and_check_inf(grads: list[torch.Tensor], inv_scale: float, device: torch.device) -> torch.Tensor:
    """Multiply ``grads`` in place by ``inv_scale``; return a 0-dim fp32 flag, 1.0 if any is inf/nan."""
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return found_inf
    inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, group in by_device.items():
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(dev))
        found_inf = torch.maximum(found_inf, flag.to(device))
    return found_inf


def step_with_divisor(
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    divisor: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``optimizer.step()`` with its gradients ``grads`` divided by the 0-dim ``divisor`` (None: as they are).

    torch's fused Adam/SGD kernels divide every gradient by their ``grad_scale`` tensor as they read
    it, so there clipping costs no pass of its own; otherwise the grads are scaled in place first. A
    divisor of exactly 1 (no clipping) leaves the gradients bit-for-bit unchanged. ``found_inf`` (a
    0-dim device flag, fused kernels only) makes them skip the step on the device.
    """
    fused = all(g.get("fused") for g in optimizer.param_groups)
    if found_inf is not None:
        assert fused, "found_inf needs torch's fused kernels"
    if (divisor is None and found_inf is None) or not grads:
        optimizer.step()
        return
    if fused:
        attrs = {"grad_scale": divisor, "found_inf": None if found_inf is None else found_inf.float()}
        attrs = {k: v for k, v in attrs.items() if v is not None}
        for k, v in attrs.items():
            setattr(optimizer, k, v)  # read by torch's fused kernels
        try:
            optimizer.step()
        finally:
            for k in attrs:
                delattr(optimizer, k)
    else:
        torch._foreach_mul_(grads, 1.0 / divisor)
        optimizer.step()


def params_l2_norm(model_chunks: list[torch.nn.Module], parallel_state: Any, device: torch.device) -> float:
    """The L2 norm of the whole model's parameters (``--log-params-norm``), the same under every
    layout: tensor-parallel shards and pipeline stages are summed over the model-parallel group,
    while tp-replicated parameters and the last stage's copy of a tied embedding count once. Expert
    parameters (a model with ``num_moe_experts``) are summed apart over the expert model-parallel
    group (expert-tp x ep x pp), where each rank holds a distinct shard. Every rank must call it
    (one all-reduce; two with experts)."""
    ps = parallel_state
    counted = [
        p for chunk in model_chunks for p in chunk.parameters() if param_is_not_duplicate(p, ps.tp_rank)
    ]
    dense = [p.detach() for p in counted if not getattr(p, "expert_parallel", False)]
    total = grad_norm_sq(dense, device)
    if ps.tp_size * ps.pp_size > 1:
        dist.all_reduce(total, group=ps.mp_group)
    # The config, not this stage's parameters, decides: every stage joins the expert group's reduction.
    if any(getattr(getattr(c, "config", None), "num_moe_experts", None) for c in model_chunks):
        experts = [p.detach() for p in counted if getattr(p, "expert_parallel", False)]
        expert_sq = grad_norm_sq(experts, device)
        group = ps.groups.get("tp_ep_pp")
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(expert_sq, group=group)
        total = total + expert_sq
    return float(total.sqrt())
