"""``--dry-run``: validate the configuration and report what a step will need, touching no GPU."""

from __future__ import annotations

from collections.abc import Callable

from megatron.training.flops import num_floating_point_operations, shape_from_config
from megatron.training.memory_estimate import (
    PLANNED_DEVICE_BYTES,
    GiB,
    Kernels,
    context_parallel_size,
    data_parallel_size,
    estimate,
    report_lines,
)
from megatron.training.memory_params import stage_params
from megatron.training.validation import planned_world_size
from megatron.training.validation_moe import expert_layout_line


def dry_run(cfg, padded_vocab_size: int, log: Callable[[str], None] = print) -> None:
    """Print the parameter count, the per-stage memory table for a GPU run (CUDA kernels: see
    ``memory_estimate``), the largest micro-batch that fits 80 GiB and 141 GiB, and the step's FLOPs.

    The whole model is built once on the meta device (every layer, no pipeline split) and its
    parameters assigned to the stages (``memory_params``)."""
    world = planned_world_size(cfg)
    params = stage_params(cfg, padded_vocab_size)
    kernels = Kernels.cuda(cfg.model, cfg.model.tensor_model_parallel_size)
    stages = estimate(cfg, padded_vocab_size, world, kernels, params=params)
    busiest = max(stages, key=lambda s: s.peak)
    t = cfg.training
    flops = num_floating_point_operations(
        shape_from_config(cfg.model, padded_vocab_size), t.global_batch_size, t.seq_length
    )
    log(f"dry run: configuration is valid for {world} process(es)")
    cp = context_parallel_size(cfg)
    if cp > 1:
        log(
            f"  context parallel: {cp} ranks per sequence, {t.seq_length // cp} of its {t.seq_length} tokens "
            f"per rank; data-parallel size {data_parallel_size(cfg, world)} (world / (tp x pp x cp)); "
            "the figures below are per rank"
        )
    if cfg.model.num_moe_experts:
        log("  " + expert_layout_line(cfg, world) + "; the figures below are per rank")
    log(f"  parameters: {params.total:,} (padded vocabulary {padded_vocab_size})")
    log(f"  pipeline stage {busiest.pp_rank} (the largest peak), per GPU:")
    summary = {
        "weights": busiest.weights,
        "gradients": busiest.gradients,
        "optimizer": busiest.optimizer,
        "activations": busiest.activations_at_peak,
    }
    if busiest.host:
        summary["host (offload)"] = busiest.host
    for k, v in summary.items():
        log(f"  {k + ' memory':<20} {v / GiB:10.2f} GiB per GPU")
    log(f"  {'total (estimate)':<20} {busiest.peak / GiB:10.2f} GiB per GPU (peak)")
    for line in report_lines(cfg, padded_vocab_size, world, kernels, PLANNED_DEVICE_BYTES, params):
        log("  " + line)
    log(f"  model FLOPs per step: {flops:.4e} ({t.global_batch_size} samples x {t.seq_length} tokens)")
    for name, peak in (("H100/H200 SXM", 989e12), ("A100", 312e12)):
        log(
            f"  predicted step time at 45% MFU on {world} x {name}: "
            f"{flops / (0.45 * peak * world) * 1e3:.1f} ms"
        )
