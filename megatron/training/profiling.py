"""``--profile``: a torch.profiler trace (or an nsys capture range) around chosen iterations.

With ``--use-pytorch-profiler`` the profiled ranks write ``trace_rank{r}.json`` (open it in Perfetto
or chrome://tracing) and ``kernels_rank{r}.txt``, GPU kernel time per profiled step summed by
category (matmul, attention, elementwise, optimizer, communication, copies) with the top kernels,
the GPU's idle time between kernels and the communication time not hidden behind compute, and
print them; the same figures (ms per step) go to ``breakdown_rank{r}.json`` for scripts. Without it, ``cudaProfilerStart``/``Stop`` bracket the iterations so
that ``nsys profile --capture-range=cudaProfilerApi`` records exactly those.
"""

from __future__ import annotations

import json
import os

import torch

# First match wins; names are lower-cased kernel names. Triton kernels (Inductor's ``triton_*`` and
# this package's own) come before matmul: Inductor names a kernel after the ops it fuses, so the FP8
# quantisation kernels feeding a scaled GEMM are called ``triton_..._scaled_mm_...``.
CATEGORIES = (
    ("communication", ("nccl",)),
    ("attention", ("fmha", "flash", "cudnn", "attn", "sdpa")),
    (
        "elementwise (triton)",
        ("triton", "_swiglu_bwd_kernel", "_ce_grad_kernel", "_cast_transpose_kernel", "_amax_kernel"),
    ),
    ("optimizer", ("adam", "sgd", "multi_tensor", "foreach", "clip")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "cublas", "matmul")),
    ("copies", ("memcpy", "memset", "copy_kernel")),
    ("elementwise (aten)", ("elementwise", "vectorized", "reduce", "softmax", "norm", "index", "embedding")),
)


# The host range around the optimizer step (training loop); kernels launched inside it are marked
# with OPTIMIZER_MARK, so that the compiled optimizer's Triton kernels count as optimizer time.
OPTIMIZER_RANGE = "megatron.optimizer_step"
OPTIMIZER_MARK = "[optimizer step] "


def categorize(name: str) -> str:
    """The category of a kernel name; one marked as launched by the optimizer step is ``optimizer``
    unless it is communication (the distributed optimizer's collectives stay communication)."""
    marked = name.startswith(OPTIMIZER_MARK)
    low = name[len(OPTIMIZER_MARK) :].lower() if marked else name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return "optimizer" if marked and category != "communication" else category
    return "optimizer" if marked else "other"


# Chrome-trace categories of work on the GPU timeline.
GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Kernel = tuple[str, float, float]  # (name, start us, end us)


def trace_events(path: str) -> list[dict]:
    """The events of an exported Chrome trace."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_kernels(path: str, events: list[dict] | None = None) -> list[Kernel]:
    """The GPU kernels, copies and memsets of an exported Chrome trace, sorted by start time.

    Read from the trace rather than from ``key_averages()``/``events()``, which leave out kernels
    the trace has (on an H200, the ~10 ms per step of gradient copies launched from autograd hooks).
    """
    events = trace_events(path) if events is None else events
    in_optimizer = _optimizer_launches(events)
    kernels = [
        (
            (OPTIMIZER_MARK if e.get("args", {}).get("correlation") in in_optimizer else "") + e["name"],
            float(e["ts"]),
            float(e["ts"]) + float(e.get("dur", 0.0)),
        )
        for e in events
        if e.get("cat") in GPU_EVENT_CATEGORIES and e.get("ph", "X") == "X"
    ]
    return sorted(kernels, key=lambda k: k[1])


def _optimizer_launches(events: list[dict]) -> set:
    """Correlation ids of the launches (runtime or driver API) the host made inside an
    ``OPTIMIZER_RANGE`` annotation."""
    ranges = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") == OPTIMIZER_RANGE
    ]
    if not ranges:
        return set()
    return {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
        and any(a <= float(e["ts"]) <= b for a, b in ranges)
    }


def host_summary(events: list[dict], steps: int, top: int = 6) -> tuple[str, dict[str, float]]:
    """(text, {thread: ms per step}): host time inside operators per thread (the outermost ops only,
    so nested ones count once; waiting in a CUDA synchronisation is not an operator), and this
    package's own ops (``megatron::``) with their host time per call. When a thread's busy time
    nears the step time, the GPU waits for the host: idle GPU time is then host time, not syncs."""
    by_tid: dict[str, list[tuple[float, float]]] = {}
    ours: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "cpu_op" or e.get("ph", "X") != "X":
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        by_tid.setdefault(str(e.get("tid")), []).append((start, start + dur))
        if e["name"].startswith("megatron::"):
            ours.setdefault(e["name"], []).append(dur)
    # operators on one thread nest, so the union of their spans is the outermost ones' time
    busy = {tid: _union_length(spans) / 1000.0 / steps for tid, spans in by_tid.items()}
    busy = {tid: ms for tid, ms in sorted(busy.items(), key=lambda kv: -kv[1]) if ms >= 1.0}
    if not busy:
        return "host: no operators recorded", {}
    lines = [
        "host time in operators per step (outermost ops; not waiting): "
        + ", ".join(f"thread {tid} {ms:.1f} ms" for tid, ms in list(busy.items())[:top])
    ]
    for name, durs in sorted(ours.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {name}: {len(durs) // max(steps, 1)} calls per step, {sum(durs) / len(durs):.0f} us each"
        )
    return "\n".join(lines), busy


def kernel_summary(kernels: list[Kernel], steps: int, top: int = 25) -> tuple[str, dict[str, float]]:
    """(text table, {category: ms per step}): GPU time per step by category and the top kernels."""
    per_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        entry = per_name.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    rows = [
        (us / 1000.0 / steps, int(count) // max(steps, 1), name) for name, (us, count) in per_name.items()
    ]
    by_cat: dict[str, float] = {}
    for ms, _, name in rows:
        cat = categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
    total = sum(by_cat.values())
    lines = [f"GPU kernel time per step: {total:.1f} ms over {steps} profiled step(s)"]
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:<22} {ms:9.2f} ms  {100 * ms / max(total, 1e-9):5.1f}%")
    lines.append(f"top {top} kernels (ms per step, launches per step, category):")
    for ms, count, name in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {ms:8.2f} {count:6d}  {categorize(name):<22} {name[:140]}")
    return "\n".join(lines), by_cat


def idle_summary(kernels: list[Kernel], steps: int, top: int = 8) -> tuple[str, float | None]:
    """(text, idle ms per step): GPU idle time between kernels over the profiled window, and the
    largest gaps (with the kernels around them)."""
    spans = sorted((start, end, name) for name, start, end in kernels)
    if not spans:
        return "GPU idle: no kernels recorded", None
    gaps, busy_end, prev = [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > busy_end:
            gaps.append((start - busy_end, prev, name))
        if end > busy_end:
            busy_end, prev = end, name
    window = (busy_end - spans[0][0]) / 1000.0
    idle = sum(g for g, _, _ in gaps) / 1000.0
    lines = [
        f"GPU idle between kernels: {idle / steps:.2f} ms per step ({100 * idle / max(window, 1e-9):.1f}% of "
        f"{window / steps:.1f} ms); largest gaps (ms, after -> before):"
    ]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1000.0:7.2f}  {before[:70]} -> {after[:70]}")
    return "\n".join(lines), idle / steps


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def exposed_communication(kernels: list[Kernel], steps: int) -> tuple[str, float, float]:
    """(text, communication ms, exposed ms) per step. Exposed: a communication kernel runs and no
    other kernel does, what overlapping communication with compute would save. In a pipeline stage
    this includes the bubble, since NCCL receive kernels wait on the GPU for their data."""
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for name, start, end in kernels:
        (comm if categorize(name) == "communication" else compute).append((start, end))
    if not comm:
        return "communication: none on this rank", 0.0, 0.0
    comm_ms = _union_length(comm) / 1000.0 / steps
    exposed_ms = (_union_length(comm + compute) - _union_length(compute)) / 1000.0 / steps
    return (
        f"communication: {comm_ms:.2f} ms per step on the GPU, {exposed_ms:.2f} ms of it exposed "
        "(no other kernel running)",
        comm_ms,
        exposed_ms,
    )


def _is_p2p(name: str) -> bool:
    """NCCL's point-to-point kernels (a pipeline's sends and receives: ``ncclDevKernel_SendRecv``)."""
    return "nccl" in name.lower() and any(s in name for s in ("SendRecv", "_Send", "_Recv"))


def exposed_pipeline_wait(kernels: list[Kernel], steps: int) -> tuple[str, float]:
    """(text, ms per step): of the exposed communication, the time a pipeline send or receive runs
    and no compute kernel does, i.e. the stage waits for its neighbour: the pipeline bubble plus any
    imbalance between stages (a receive kernel spins on the GPU until its data arrives)."""
    p2p = [(start, end) for name, start, end in kernels if _is_p2p(name)]
    if not p2p:
        return "", 0.0
    compute = [(start, end) for name, start, end in kernels if categorize(name) != "communication"]
    ms = (_union_length(p2p + compute) - _union_length(compute)) / 1000.0 / steps
    return (
        f"  of it waiting in pipeline sends/receives (bubble and stage imbalance): {ms:.2f} ms per step",
        ms,
    )


class StepProfiler:
    """Call :meth:`before_step` with the iteration about to run (1-based) and :meth:`after_step`
    after it; does nothing unless ``--profile`` is on for this rank."""

    def __init__(self, logger_cfg, rank: int, device: torch.device, default_dir: str | None):
        self.cfg = logger_cfg
        self.enabled = bool(logger_cfg.profile) and rank in logger_cfg.profile_ranks
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.dir = logger_cfg.profile_dir or default_dir or "profile"
        self.prof: torch.profiler.profile | None = None
        self.active = False
        if self.enabled and not self.cuda and not logger_cfg.use_pytorch_profiler:
            print(
                " > --profile without --use-pytorch-profiler only marks a capture range for nsys on a GPU, so on the "
                "CPU nothing is recorded; add --use-pytorch-profiler for a trace and a time summary",
                flush=True,
            )

    def before_step(self, iteration: int) -> None:
        if not self.enabled or self.active or iteration != self.cfg.profile_step_start:
            return
        if self.cfg.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                record_shapes=self.cfg.pytorch_profiler_collect_shapes,
                with_stack=self.cfg.pytorch_profiler_collect_callstack,
            )
            self.prof.__enter__()
        elif self.cuda:
            torch.cuda.cudart().cudaProfilerStart()
        self.active = True

    def after_step(self, iteration: int) -> str | None:
        """Stop after the last profiled iteration; returns the summary line(s) to print, if any."""
        if not self.active or iteration + 1 < self.cfg.profile_step_end:
            return None
        self.active = False
        if self.cuda:
            torch.cuda.synchronize()
        if self.prof is None:
            if self.cuda:
                torch.cuda.cudart().cudaProfilerStop()
            return None
        self.prof.__exit__(None, None, None)
        steps = self.cfg.profile_step_end - self.cfg.profile_step_start
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"trace_rank{self.rank}.json")
        self.prof.export_chrome_trace(trace)
        events = trace_events(trace)
        kernels = trace_kernels(trace, events)
        text, by_category = kernel_summary(kernels, steps)
        idle_text, idle_ms = idle_summary(kernels, steps)
        comm_text, comm_ms, exposed_ms = exposed_communication(kernels, steps)
        p2p_text, p2p_ms = exposed_pipeline_wait(kernels, steps)
        host_text, host_ms = host_summary(events, steps)
        text += "\n" + idle_text + "\n" + comm_text + ("\n" + p2p_text if p2p_text else "") + "\n" + host_text
        with open(os.path.join(self.dir, f"kernels_rank{self.rank}.txt"), "w") as f:
            f.write(text + "\n")
        breakdown = {
            "kernel_ms": sum(by_category.values()),
            "by_category_ms": by_category,
            "idle_ms": idle_ms,
            "communication_ms": comm_ms,
            "exposed_communication_ms": exposed_ms,
            "exposed_pipeline_wait_ms": p2p_ms,
            "host_ops_ms": list(host_ms.values()),
        }
        with open(os.path.join(self.dir, f"breakdown_rank{self.rank}.json"), "w") as f:
            json.dump(breakdown, f, indent=1)
        self.prof = None
        return (
            f" > profile of iterations {self.cfg.profile_step_start}-{self.cfg.profile_step_end - 1} "
            f"(rank {self.rank}) written to {trace}\n{text}"
        )
