"""Per-rank memory of a training run, per pipeline stage: what this code allocates, term by term.

Every tensor-, context- and data-parallel rank of a pipeline stage holds the same, so one row per stage
(all virtual chunks of the rank together) describes every GPU. Context parallelism over ``N`` ranks
divides every activation by ``N`` (each rank holds ``S / N`` tokens of a sequence); parameters,
gradients and optimizer state are replicated over cp, except the distributed optimizer's and FSDP2's
shards, which are over dp x cp. Expert parameters hold this rank's E / ep experts split over
expert-tp, and the distributed optimizer shards them over expert-dp; an MoE layer's activations count
the routed rows (tokens x k, balanced). The terms follow how this code uses memory:

* weights: the parameters in their dtype (with the distributed optimizer, the padded param buffer
  they are views of; with FSDP2, this rank's dim-0 shard in fp32, which is also the optimizer's main
  param, plus the bf16 parameters FSDP2 gathers: the root's for the whole step, one layer and the
  prefetched next in flight, every layer of the stage from forward to backward with ``optim_grads``);
* gradients (``DistributedDataParallel``): bucket storage in the reduction dtype, allocated at a
  bucket's first gradient of a step and released when the next step starts. A parameter's only
  gradient of the step is its ``main_grad`` as is (no bucket memory) without data-parallel reduction,
  or with it when the parameter's dtype is the reduction's; a second micro-batch moves it into the
  bucket. The distributed optimizer reduce-scatters the whole padded buffer; FSDP2 keeps this rank's
  fp32 gradient shard (and, while ``no_sync`` accumulates micro-batches, the unsharded fp32 ones);
* optimizer state: fp32 main params of bf16/fp16 params (fp32 params are their own main) and Adam's
  two moments (SGD: one); distributed optimizer: this rank's 1/dp of every bucket padded to
  lcm(dp, 128); FSDP2: of this rank's shard; ``--optimizer-cpu-offload`` moves that fraction of the
  main params and moments (and a gradient copy) to the host;
* activations: the tensors autograd saves for backward, per layer (:func:`layer_activation_bytes`),
  times the micro-batches alive on the stage at once (1F1B: ``min(pp - rank, M)``; interleaved:
  Megatron's warm-up count, simulated round by round), plus the stage's ends (embedding, final norm,
  output layer + loss) and, while a checkpointed group is recomputed, that group's activations;
* the caching allocator's peak: weights + optimizer state + the largest of (activations alive after a
  forward + gradients already allocated + that forward's transient buffers) and (the same at each
  backward's start and end), and the optimizer step (gradients + widened copies).

Device-dependent terms follow the CUDA path (``Kernels.cuda``): SDPA's fused kernels (flash/cuDNN:
no score matrix), the fused RMSNorm (input and fp32 rstd saved), bool dropout masks, the Triton
SwiGLU (saves only fc1's output), the fused output layer + cross entropy at tp 1 (``linear_cross_
entropy``: the logits of one token chunk at a time, ``G_h``/``G_W`` held to backward). A compiled
layer's saved tensors are taken as the eager layer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.core.execution_plan import ExecutionPlan
from megatron.core.pipeline_parallel.interleaved import RoundPlan
from megatron.training.memory_activations import (
    ChunkTerms,
    Kernels,
    activation_shape,
    backward_working_set,
    chunk_activations,
    stage_end_activations,
)
from megatron.training.memory_params import StageParams, stage_params
from megatron.training.memory_state import StaticTerms, chunk_static, fp8_state_bytes

GiB = float(2**30)


@dataclass
class StageMemory:
    """One rank of pipeline stage ``pp_rank`` (bytes unless named otherwise)."""

    pp_rank: int
    num_layers: int
    params: int
    weights: float
    gradients: float
    optimizer: float
    host: float
    activations_per_microbatch: float
    microbatches_in_flight: float
    activations_at_peak: float
    logits: float
    fsdp_gathered: float
    other: float
    peak: float

    @property
    def total(self) -> float:
        return self.peak


def _events(cfg, pp_rank: int, microbatches: int) -> list[tuple[str, int]]:
    """This rank's forward ("F") and backward ("B") passes of one step, in order, with their chunk."""
    m = cfg.model
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:
        group = m.microbatch_group_size_per_vp_stage or pp
        plan = RoundPlan(microbatches, vpp, pp, max(group, pp), False)
        events = []
        for t in range(-1, plan.last_round(pp_rank) + 1):
            k = plan.fwd(pp_rank, t)
            if k is not None:
                events.append(("F", plan.fchunk(k)))
            k = plan.bwd(pp_rank, t)
            if k is not None:
                events.append(("B", plan.bchunk(k)))
        return events
    warmup = min(pp - pp_rank - 1, microbatches)
    return (
        [("F", 0)] * warmup
        + [e for _ in range(microbatches - warmup) for e in (("F", 0), ("B", 0))]
        + [("B", 0)] * warmup
    )


def _simulate(
    events: list[tuple[str, int]], terms: list[ChunkTerms], statics: list[StaticTerms], step_extra: float
) -> tuple[float, float, float]:
    """(peak above the static memory, activations held then, micro-batches of activations alive at most)."""
    done = [0] * len(terms)
    held = 0.0
    live = max_live = 0
    peak, held_at_peak = 0.0, 0.0
    in_flight = sum(s.gathered_in_flight for s in statics)

    def grads() -> float:
        return sum(
            0.0 if d == 0 else s.gradients_first if d == 1 else s.gradients_more
            for d, s in zip(done, statics)
        )

    def see(value: float, acts: float) -> None:
        nonlocal peak, held_at_peak
        if value > peak:
            peak, held_at_peak = value, acts

    for kind, c in events:
        t, s = terms[c], statics[c]
        if kind == "F":
            held += t.activations
            live += 1
            max_live = max(max_live, live)
            see(held + grads() + t.forward_transient + in_flight, held)
        else:
            see(held + grads() + t.backward_transient + t.recompute + s.backward_extra + in_flight, held)
            held -= t.activations
            live -= 1
            done[c] += 1
            see(held + grads(), held)
    see(grads() + step_extra, 0.0)
    return peak, held_at_peak, max_live / len(terms)


def context_parallel_size(cfg) -> int:
    return getattr(cfg.model, "context_parallel_size", 1) or 1


def data_parallel_size(cfg, world_size: int) -> int:
    """world / (tp x pp x cp): the ranks that take different samples."""
    m = cfg.model
    return max(
        1,
        world_size
        // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * context_parallel_size(cfg)),
    )


def estimate(
    cfg,
    padded_vocab_size: int,
    world_size: int,
    kernels: Kernels | None = None,
    micro_batch_size: int | None = None,
    params: StageParams | None = None,
) -> list[StageMemory]:
    """One :class:`StageMemory` per pipeline stage (``micro_batch_size``: instead of the config's)."""
    m, t = cfg.model, cfg.training
    kernels = kernels if kernels is not None else Kernels.cuda(m, m.tensor_model_parallel_size)
    params = params if params is not None else stage_params(cfg, padded_vocab_size)
    mbs = micro_batch_size or t.micro_batch_size
    dp = data_parallel_size(cfg, world_size)
    microbatches = max(1, (t.global_batch_size or mbs * dp) // (mbs * dp))
    shape = activation_shape(cfg, mbs)
    # Expert parameters are replicated over expert-dp = world / (etp x ep x pp) ranks.
    expt_dp = max(
        1,
        world_size
        // (m.expert_tensor_parallel_size * m.expert_model_parallel_size * m.pipeline_model_parallel_size),
    )
    one_pass = cfg.optimizer.optimizer == "adam" and cfg.optimizer.use_fused_adam and not m.fp16
    rows = []
    for r, chunks in enumerate(params.chunks):
        terms, statics = [], []
        logits = other = 0.0
        for chunk in chunks:
            acts, recompute = chunk_activations(cfg, shape, kernels, params, chunk)
            saved, fwd, bwd, lg = stage_end_activations(cfg, shape, kernels, chunk, padded_vocab_size)
            work = backward_working_set(shape) if chunk.num_layers else 0.0
            # Gradients are reduced, and the distributed optimizer / FSDP2 shard, over dp x cp (the cp
            # ranks of a sequence hold replicas of every parameter).
            static = chunk_static(cfg, chunk, dp * context_parallel_size(cfg), microbatches, expt_dp)
            terms.append(ChunkTerms(acts + saved, recompute, fwd, bwd + work, lg, 0.0, 0.0))
            statics.append(static)
            logits += lg
            other += fp8_state_bytes(cfg, kernels, chunk)
        single = sum(s.single_grads for s in statics)
        step_extra = 0.0 if one_pass or microbatches > 1 else single * 4.0  # widened fp32 copies
        over, held, alive = _simulate(_events(cfg, r, microbatches), terms, statics, step_extra)
        weights = sum(s.weights for s in statics)
        optimizer = sum(s.optimizer for s in statics)
        gathered = sum(s.gathered for s in statics)
        rows.append(
            StageMemory(
                pp_rank=r,
                num_layers=sum(c.num_layers for c in chunks),
                params=sum(i.numel for c in chunks for i in c.params),
                weights=weights,
                gradients=sum(s.gradients_more if microbatches > 1 else s.gradients_first for s in statics),
                optimizer=optimizer,
                host=sum(s.host for s in statics),
                activations_per_microbatch=sum(x.activations for x in terms),
                microbatches_in_flight=alive,
                activations_at_peak=held,
                logits=logits,
                fsdp_gathered=gathered + sum(s.gathered_in_flight for s in statics),
                other=other,
                peak=weights + optimizer + gathered + other + over,
            )
        )
    return rows


def largest_micro_batch(
    cfg,
    padded_vocab_size: int,
    world_size: int,
    device_bytes: float,
    kernels: Kernels | None = None,
    params: StageParams | None = None,
    limit: int = 1 << 14,
) -> tuple[int, float] | None:
    """The largest micro-batch size whose busiest stage fits ``device_bytes`` (and that peak), or None."""
    kernels = (
        kernels if kernels is not None else Kernels.cuda(cfg.model, cfg.model.tensor_model_parallel_size)
    )
    params = params if params is not None else stage_params(cfg, padded_vocab_size)

    def peak(mbs: int) -> float:
        return max(s.peak for s in estimate(cfg, padded_vocab_size, world_size, kernels, mbs, params))

    if peak(1) > device_bytes:
        return None
    lo, hi = 1, 2
    while hi <= limit and peak(hi) <= device_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= device_bytes else (lo, mid)
    return lo, peak(lo)


COLUMNS = (
    "stage",
    "layers",
    "params",
    "weights",
    "grads",
    "optim",
    "host",
    "act/mb",
    "in flight",
    "act@peak",
    "logits",
    "fsdp",
    "peak",
)


def format_table(stages: list[StageMemory], device_bytes: float | None = None) -> list[str]:
    """The per-stage table per GPU (every tp / cp / dp rank of a stage holds the same), in GiB (MiB when
    every peak is below 1 GiB)."""
    worst = max(stages, key=lambda s: s.peak)
    unit, name = (GiB, "GiB") if worst.peak >= GiB else (float(2**20), "MiB")
    lines = [
        f"memory per GPU ({name}) by pipeline stage; act/mb: activations of one micro-batch, in flight: "
        "micro-batches alive at once, act@peak: activations held at the peak, host: offloaded state"
    ]
    lines.append(" ".join(f"{c:>9}" for c in COLUMNS))
    for s in stages:
        values = (s.weights, s.gradients, s.optimizer, s.host, s.activations_per_microbatch)
        row = [f"{s.pp_rank:>9}", f"{s.num_layers:>9}", f"{s.params / 1e9:>8.2f}B"]
        row += [f"{v / unit:>9.2f}" for v in values]
        row += [f"{s.microbatches_in_flight:>9.2f}"]
        row += [f"{v / unit:>9.2f}" for v in (s.activations_at_peak, s.logits, s.fsdp_gathered, s.peak)]
        lines.append(" ".join(row))
    if device_bytes:
        verdict = "fits" if worst.peak <= device_bytes else "does NOT fit"
        lines.append(
            f"  peak {worst.peak / GiB:.2f} GiB on pipeline stage {worst.pp_rank}: {verdict} in "
            f"{device_bytes / GiB:.0f} GiB ({100 * worst.peak / device_bytes:.0f}%)"
        )
    return lines


def micro_batch_line(result: tuple[int, float] | None, device_bytes: float) -> str:
    """One line: the largest micro-batch size that fits ``device_bytes``."""
    if result is None:
        return (
            f"  largest micro-batch that fits {device_bytes / GiB:.0f} GiB: none (micro-batch 1 does not fit)"
        )
    mbs, peak = result
    return f"  largest micro-batch that fits {device_bytes / GiB:.0f} GiB: {mbs} (peak {peak / GiB:.2f} GiB)"


# The GPU memory sizes a dry run plans for (H100/H200 80 GB, H200 141 GB), in bytes as CUDA reports them.
PLANNED_DEVICE_BYTES = (80 * GiB, 141 * GiB)


def report_lines(
    cfg,
    padded_vocab_size: int,
    world_size: int,
    kernels: Kernels,
    device_bytes: tuple[float, ...] = (),
    params: StageParams | None = None,
) -> list[str]:
    """The per-stage table and, for each of ``device_bytes``, the largest micro-batch that fits."""
    params = params if params is not None else stage_params(cfg, padded_vocab_size)
    stages = estimate(cfg, padded_vocab_size, world_size, kernels, params=params)
    lines = format_table(stages, device_bytes[0] if len(device_bytes) == 1 else None)
    for size in device_bytes:
        best = largest_micro_batch(cfg, padded_vocab_size, world_size, size, kernels, params)
        lines.append(micro_batch_line(best, size))
    return lines


def report_memory(
    cfg,
    padded_vocab_size: int,
    world_size: int,
    plan: ExecutionPlan,
    device: torch.device,
    rank: int,
    log: Callable[[str], None] = print,
) -> None:
    """Start-up: rank 0 logs the table for the run's plan and, on a GPU, the largest micro-batch that
    fits its memory. The whole model is built on meta for the parameter count (global RNG untouched)."""
    if rank != 0:
        return
    with torch.random.fork_rng(devices=[]):
        params = stage_params(cfg, padded_vocab_size)
    total = (float(torch.cuda.get_device_properties(device).total_memory),) if device.type == "cuda" else ()
    lines = report_lines(cfg, padded_vocab_size, world_size, Kernels.from_plan(plan), total, params)
    log("\n".join([" > memory estimate (" + plan.device_type + " kernels)"] + lines))
