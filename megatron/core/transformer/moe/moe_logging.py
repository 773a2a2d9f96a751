"""The MoE metric tracker: per-layer values the routers record in forward (device tensors, no host
sync), reduced across ranks and turned into log values once per step (Megatron-Core's
``moe_logging``; ``moe_utils`` re-exports the public names).

Entries are ``[num_layers, ...]`` tensors summed over the step's micro-batches; an entry names the
group its values are summed over, the group they are averaged over, and whether they are then
averaged over the data-parallel group.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size


@dataclass
class _Entry:
    values: torch.Tensor  # [num_layers, ...], summed over the step's micro-batches
    reduce_group: ProcessGroup | None = None  # summed over it at log time
    avg_group: ProcessGroup | None = None  # then averaged over it
    needs_dp_avg: bool = True  # then averaged over the data-parallel group
    live: bool = False  # recorded (or force-initialised) since the last clear


_AUX_LOSSES: dict[str, _Entry] = {}
_STATS: dict[str, _Entry] = {}
# Routers with per-step bookkeeping (graph-less first passes awaiting their recompute), reset with
# the tracker: a recompute never crosses a step.
ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()

# Names of the losses and statistics the router records (Megatron-Core's loss names).
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
STAT_NAMES = ("tokens_per_expert", "dropped_tokens", "routed_tokens")


def in_backward() -> bool:
    """True while autograd runs a backward (an activation-recompute forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


def _record(
    table: dict[str, _Entry],
    name: str,
    value: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: ProcessGroup | None,
    avg_group: ProcessGroup | None,
    needs_dp_avg: bool,
) -> None:
    if not 1 <= layer_number <= num_layers:
        raise ValueError(f"layer_number {layer_number} is not in [1, {num_layers}]")
    value = value.detach().float()
    entry = table.get(name)
    shape = (num_layers, *value.shape)
    if entry is None or entry.values.shape != shape or entry.values.device != value.device:
        entry = table[name] = _Entry(torch.zeros(shape, device=value.device))
    entry.values[layer_number - 1] += value
    entry.live = True
    entry.reduce_group, entry.avg_group, entry.needs_dp_avg = reduce_group, avg_group, needs_dp_avg


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: ProcessGroup | None = None,
    avg_group: ProcessGroup | None = None,
    needs_dp_avg: bool = True,
) -> None:
    """Add ``loss`` (a scalar tensor, detached) to layer ``layer_number`` (1-based) of ``name``.

    At log time the values are summed over ``reduce_group``, averaged over ``avg_group`` and, with
    ``needs_dp_avg``, over the data-parallel group."""
    _record(_AUX_LOSSES, name, loss, layer_number, num_layers, reduce_group, avg_group, needs_dp_avg)


def save_to_moe_stats_tracker(
    name: str,
    value: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: ProcessGroup | None = None,
) -> None:
    """Add a routing statistic (a tensor of any fixed shape, e.g. ``[E]`` counts) to layer
    ``layer_number``; summed over the micro-batches and over ``reduce_group`` at log time."""
    _record(_STATS, name, value, layer_number, num_layers, reduce_group, None, False)


def _legacy(table: dict[str, _Entry]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "values": e.values,
            "reduce_group": e.reduce_group,
            "avg_group": e.avg_group,
            "needs_dp_avg": e.needs_dp_avg,
        }
        for name, e in table.items()
    }


def get_moe_layer_wise_logging_tracker() -> dict[str, dict[str, Any]]:
    """The aux-loss tracker: ``{name: {"values": [num_layers] tensor, "reduce_group", "avg_group",
    "needs_dp_avg"}}`` (Megatron-Core's format)."""
    return _legacy(_AUX_LOSSES)


def get_moe_stats_tracker() -> dict[str, dict[str, Any]]:
    """The routing-statistics tracker, in the same format (values ``[num_layers, ...]``)."""
    return _legacy(_STATS)


def clear_aux_losses_tracker() -> None:
    """Zero every recorded loss and statistic (entries and their storage are reused); call once
    per step (``track_moe_metrics`` does)."""
    for entry in (*_AUX_LOSSES.values(), *_STATS.values()):
        entry.values.zero_()
        entry.live = False
    for router in ROUTERS:
        router._unrecorded_passes = 0


def _live(table: dict[str, _Entry]) -> list[str]:
    """Names recorded since the last clear, sorted (every rank reduces them in the same order)."""
    return sorted(n for n, e in table.items() if e.live)


def _ensure(table: dict[str, _Entry], name: str, shape: tuple[int, ...], device: torch.device) -> None:
    entry = table.get(name)
    if entry is None or entry.values.shape != shape:
        entry = table[name] = _Entry(torch.zeros(shape, device=device))
    entry.live = True


def reduce_aux_losses_tracker_across_ranks(
    track_names: Iterable[str] | None = None,
    pp_group: ProcessGroup | None = None,
    dp_group: ProcessGroup | None = None,
) -> None:
    """Reduce the recorded values in place: sum over ``pp_group`` (stages hold different layers'
    rows), sum over each entry's reduce group, average over its avg group, then average over
    ``dp_group`` where the entry asks for it. Every rank of these groups must call this with the
    same names (see ``track_moe_metrics``'s ``force_initialize``). Default: the losses recorded
    since the last clear; the recorded statistics always."""
    names = _live(_AUX_LOSSES) if track_names is None else list(track_names)
    entries = [_AUX_LOSSES[n] for n in names if n in _AUX_LOSSES] + [_STATS[n] for n in _live(_STATS)]
    for e in entries:
        if group_size(pp_group) > 1:
            dist.all_reduce(e.values, group=pp_group)
        if group_size(e.reduce_group) > 1:
            dist.all_reduce(e.values, group=e.reduce_group)
        if group_size(e.avg_group) > 1:
            dist.all_reduce(e.values, group=e.avg_group)
            e.values /= group_size(e.avg_group)
        if e.needs_dp_avg and group_size(dp_group) > 1:
            dist.all_reduce(e.values, group=dp_group)
            e.values /= group_size(dp_group)


def num_moe_layers(num_layers: int, moe_layer_freq: int | list[int] | None = None) -> int:
    """MoE layers among ``num_layers``: every ``moe_layer_freq``-th (from layer 0), or the 1s of a
    pattern list."""
    if moe_layer_freq is None:
        return num_layers
    if isinstance(moe_layer_freq, int):
        return sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    return sum(moe_layer_freq)


def _stat_metrics(per_layer_logging: bool) -> dict[str, float]:
    """Imbalance (max / mean tokens per expert) and the dropped fraction from the reduced stats."""
    out: dict[str, float] = {}
    if set(STAT_NAMES) - set(_live(_STATS)):
        return out
    counts = _STATS["tokens_per_expert"].values  # [L, E]
    layers = (counts.sum(dim=1) > 0).nonzero().flatten().tolist()
    if not layers:
        return out
    counts = counts.double().cpu()
    imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-30)
    dropped = _STATS["dropped_tokens"].values.double().cpu()
    routed = _STATS["routed_tokens"].values.double().cpu()
    out["expert_load_imbalance"] = float(imbalance[layers].mean())
    out["expert_load_imbalance_max"] = float(imbalance[layers].max())
    out["dropped_token_fraction"] = float(dropped[layers].sum() / routed[layers].sum().clamp_min(1))
    if per_layer_logging:
        for i in layers:
            out[f"moe/expert_load_imbalance_layer_{i}"] = float(imbalance[i])
            out[f"moe/dropped_token_fraction_layer_{i}"] = float(dropped[i] / max(float(routed[i]), 1.0))
            for j, c in enumerate(counts[i].tolist()):
                out[f"moe/tokens_per_expert_layer_{i}/expert_{j}"] = c
    return out


def track_moe_metrics(
    loss_scale: float,
    iteration: int | None = None,
    writer: Any = None,
    wandb_writer: Any = None,
    total_loss_dict: dict[str, Any] | None = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: Iterable[str] | None = None,
    num_layers: int | None = None,
    moe_layer_freq: int | list[int] | None = None,
    num_experts: int | None = None,
    pp_group: ProcessGroup | None = None,
    dp_group: ProcessGroup | None = None,
) -> dict[str, float]:
    """Reduce the step's recorded values across ranks, turn them into log values, write them to
    TensorBoard / W&B when given, and clear the tracker. Call once per step on every rank.

    Returns ``{name: value}``: each aux loss (``"load_balancing_loss"``, ``"z_loss"``, ...) times
    ``loss_scale`` (``1 / num_microbatches``), averaged over the MoE layers (with
    ``per_layer_logging`` also ``"moe/{name}_layer_{i}"``); ``"expert_load_imbalance"`` (max / mean
    tokens per expert, averaged over the MoE layers; ``_max`` the worst layer) and
    ``"dropped_token_fraction"`` (dropped / routed token-expert pairs), with ``per_layer_logging``
    per layer and the tokens per expert. Losses are also added to ``total_loss_dict``.

    Args:
        force_initialize: create zero entries for ``track_names`` and the statistics first (a
            pipeline stage without MoE layers must still take part in the reductions); needs
            ``num_layers`` and ``num_experts``.
        num_layers, moe_layer_freq: the model's layers and MoE pattern (the average's divisor);
            default: the number of recorded layers.
    """
    names = _live(_AUX_LOSSES) if track_names is None else list(track_names)
    if force_initialize:
        assert num_layers is not None and num_experts is not None
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        dev = dev or torch.device("cpu")
        for n in names:
            _ensure(_AUX_LOSSES, n, (num_layers,), dev)
        _ensure(_STATS, "tokens_per_expert", (num_layers, num_experts), dev)
        _ensure(_STATS, "dropped_tokens", (num_layers,), dev)
        _ensure(_STATS, "routed_tokens", (num_layers,), dev)
    reduce_aux_losses_tracker_across_ranks(names, pp_group=pp_group, dp_group=dp_group)
    present = [n for n in names if n in _AUX_LOSSES]
    out: dict[str, float] = {}
    if present:
        values = [_AUX_LOSSES[n].values.float() for n in present]  # [L] each
        flat = (torch.cat(values) * loss_scale).cpu().tolist()  # the one host sync for the losses
        starts = [0]
        for t in values:
            starts.append(starts[-1] + t.numel())
        for n, a, b in zip(present, starts, starts[1:]):
            row = flat[a:b]
            divisor = num_moe_layers(num_layers, moe_layer_freq) if num_layers else len(row)
            out[n] = sum(row) / max(divisor, 1)
            if total_loss_dict is not None:
                total_loss_dict[n] = total_loss_dict.get(n, 0.0) + out[n]
            if per_layer_logging:
                out.update({f"moe/{n}_layer_{i}": v for i, v in enumerate(row) if v != 0.0})
    out.update(_stat_metrics(per_layer_logging))
    if iteration is not None:
        for k, v in out.items():
            if writer is not None:
                writer.add_scalar(k, v, iteration)
            if wandb_writer is not None:
                wandb_writer.log({k: v}, iteration)
    clear_aux_losses_tracker()
    return out
