"""--log-straggler: at every log interval, each rank's time per iteration, gathered on the world
group, and the slowest ranks named by rank 0 against the median.

In synchronous training every rank's wall time per iteration is the same (the fast ones wait for the
slow one in the gradient all-reduce), so the time that tells a straggler is the main thread's own
busy time (``time.thread_time``: a thread that waits in a gloo collective or sleeps on a file read
does not run). On a GPU the host's busy time includes the launches and CUDA's spin-wait at the
step's one synchronisation, so the figure there is the host's, not the device's; the wall time is
printed beside it. The gather is one all-gather of two numbers per rank at each log interval
(``note_iteration``); nothing is timed on the other iterations but two clock reads.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

MAX_NAMED = 4  # slow ranks named in one line
SLOW = 1.2  # a rank this many times the median busy time is named (the slowest always is)


class StragglerLog:
    """Per-rank busy and wall time per iteration since the last log interval."""

    def __init__(self, log_interval: int, device: torch.device) -> None:
        self.log_interval, self.device = log_interval, device
        self._start()

    def _start(self) -> None:
        self.steps = 0
        self.wall0, self.busy0 = time.perf_counter(), time.thread_time()

    def step(self, iteration: int) -> str | None:
        """After ``iteration``: at a log interval gather every rank's times (every rank calls this at
        the same iterations) and return rank 0's line; None elsewhere."""
        self.steps += 1
        if iteration % self.log_interval != 0:
            return None
        n = max(self.steps, 1)
        mine = torch.tensor(
            [(time.thread_time() - self.busy0) / n, (time.perf_counter() - self.wall0) / n],
            dtype=torch.float64,
            device=self.device,
        )
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        self._start()
        if dist.get_rank() != 0:
            return None
        return straggler_line(iteration, [(float(r[0]), float(r[1])) for r in rows])


def straggler_line(iteration: int, times: list[tuple[float, float]]) -> str:
    """``times``: (busy, wall) seconds per iteration of each rank, by rank."""
    busy = [b for b, _ in times]
    median = statistics.median(busy)
    order = sorted(range(len(busy)), key=lambda r: -busy[r])
    named = [r for r in order[:MAX_NAMED] if r == order[0] or busy[r] >= SLOW * median]

    def ratio(r: int) -> str:
        return f"{busy[r] / median:.2f}x" if median > 0 else "n/a"

    slow = ", ".join(f"rank {r} {busy[r] * 1e3:.1f} ms ({ratio(r)})" for r in named)
    fastest = order[-1]
    walls = [w for _, w in times]
    return (
        f"stragglers at iteration {iteration}: busy time per iteration, slowest {slow} vs the median "
        f"{median * 1e3:.1f} ms (fastest rank {fastest} {busy[fastest] * 1e3:.1f} ms); "
        f"wall time per iteration {min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f} ms"
    )
