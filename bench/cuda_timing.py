"""Timing one GPU call at a time with CUDA events, for the kernel benches."""

from __future__ import annotations

import statistics
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
