"""Timing one GPU call at a time with CUDA events, for the kernel benches."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(
    fn: Callable[[], object], iters: int, warmup: int = 0, before: Callable[[], object] | None = None
) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, each timed alone (the device synchronised after each),
    after ``warmup`` untimed calls; ``before`` (untimed) runs ahead of every call, e.g. to restore an
    input that ``fn`` overwrites."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median ms of ``fn()``: CUDA events on a GPU (two warm-up calls), the wall clock elsewhere (one)."""
    if device.type == "cuda":
        return median_ms(fn, iters, warmup=2)
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
