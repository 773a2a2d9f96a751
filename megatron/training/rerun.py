"""Bad steps caught before the update: NaN/Inf losses and gradients, loss spikes, re-runs, drills.

A step is *rejected* on the device, before the optimizer touches anything, when its loss or its
gradient norm is NaN/Inf (``--check-for-nan-in-loss-and-grad``), when its loss is a spike
(``--check-for-spiky-loss``) or when it is one of ``--iterations-to-skip``. The flags ride in the
optimizer's one all-reduce of the norms (``MegatronOptimizer.step(reject=...)``), so every rank
agrees and nothing waits for the host: a rejected step leaves every weight, moment and step count as
it was (the one-pass AdamW's ``keep``, torch's fused ``found_inf``).

The host learns of it when it reads the step, one step later (the loop queues step k + 1 before it
reads step k). Then, per ``--rerun-mode`` (Megatron's modes):

* ``validate_results``: step k + 1 was queued *poisoned* (rejected too, whatever it computed), so the
  weights are still those step k started from. Step k is re-run in place: the same micro-batches
  (:class:`ReplayIterators`), the same random state, the same learning rate. Not reproduced, the fault
  was transient: the re-run's update is the step's. Reproduced, the batch is skipped (counted as a
  skipped iteration); a second reproduced step right after a skipped one means the weights, not the
  data, are bad, and the run stops (exit 3). Then step k + 1 is queued again with its own batch.
* ``report_stats``: every step runs twice (the first run rejected), and the relative difference of
  the two runs' losses and gradient norms is reported at every log line.
* ``disabled``: no re-run; a NaN/Inf stops the run (exit 3) with the weights untouched, a spike is a
  warning (Megatron: not fatal) and the step is taken.

Every rejection names the ranks and, for gradients, the first parameter (in model order) whose local
gradient, before the data-parallel reduction, was NaN/Inf (``DistributedDataParallel.local_grad_norms``).

Drills (``--error-injection-*``): a fault is injected on chosen ranks at chosen (or random) steps: a
NaN in the gradients flowing out of a model chunk (the loss stays finite), or a loss (and gradient)
scaled by :data:`SPIKE_INJECTION`. ``transient_error`` injects in the first run only;
``persistent_error`` and ``correct_result`` in the re-run too (one process cannot re-run on another
GPU, which is what tells those two apart in Megatron-LM).
"""

from __future__ import annotations

import datetime
import math
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.training.loop_utils import wrap_each_iterator

SPIKE_FACTOR = 10.0  # a loss this many times the reference is a spike (Megatron-LM's factor)
SPIKE_WINDOW = 10  # the reference: the median of the last this many accepted steps' losses
SPIKE_WARMUP = 5  # accepted steps before any loss is judged
SPIKE_INJECTION = 1000.0  # --error-injection-kind spiky_loss scales the loss by this
REPRODUCED = ("persistent_error", "correct_result")  # injection types a re-run reproduces


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward makes every gradient NaN (a drill's corrupted gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * float("nan")


@dataclass
class Verdict:
    """What the host makes of a step: ``applied`` its update was kept; ``reasons`` why not (names);
    ``report`` the line naming ranks and parameters (empty when applied)."""

    applied: bool
    reasons: list[str] = field(default_factory=list)
    report: str = ""


class ReplayIterators:
    """Wraps the per-chunk training iterators (a list, entries possibly shared or None) so that the
    micro-batches each step drew can be drawn again: ``begin(k)`` before step k draws, ``rewind([k,
    k + 1])`` to replay them in order before the live iterator continues. Keeps the last two steps."""

    def __init__(self, iterators: Any) -> None:
        self.steps: dict[int, dict[int, list]] = {}
        self.current: int | None = None
        self.queue: dict[int, list] = {}
        self.iterators = wrap_each_iterator(iterators, lambda it, slot: _Replaying(self, it, slot))

    def begin(self, iteration: int) -> None:
        self.current = iteration
        self.steps[iteration] = {}
        for old in [k for k in self.steps if k < iteration - 1]:
            del self.steps[old]

    def rewind(self, iterations: list[int]) -> None:
        self.queue = {}
        for k in iterations:
            for slot, batches in self.steps.get(k, {}).items():
                self.queue.setdefault(slot, []).extend(batches)

    def _next(self, slot: int, live: Iterator) -> Any:
        queued = self.queue.get(slot)
        item = queued.pop(0) if queued else next(live)
        if self.current is not None:
            self.steps[self.current].setdefault(slot, []).append(item)
        return item


class _Replaying:
    def __init__(self, owner: ReplayIterators, live: Iterator, slot: int) -> None:
        self.owner, self.live, self.slot = owner, live, slot

    def __iter__(self) -> _Replaying:
        return self

    def __next__(self) -> Any:
        return self.owner._next(self.slot, self.live)


class RandomState:
    """Python, NumPy, torch (CPU and CUDA) and the tensor-parallel tracker's states, per step."""

    def __init__(self, rng_tracker: Any) -> None:
        self.tracker = rng_tracker
        self.saved: dict[int, dict] = {}

    def save(self, iteration: int) -> None:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            # This process's device only: asking for every visible GPU's would create a context on each.
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
            "tracker": self.tracker.get_states() if self.tracker is not None else None,
        }
        self.saved[iteration] = state
        for old in [k for k in self.saved if k < iteration - 1]:
            del self.saved[old]

    def restore(self, iteration: int) -> None:
        state = self.saved[iteration]
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"])
        if state["tracker"] is not None:
            self.tracker.set_states(state["tracker"])


class StepGuard:
    """The checks of one run (built by the trainer when any of them is on)."""

    def __init__(self, cfg: Any, device: torch.device, rank: int) -> None:
        t = cfg.training
        self.mode = t.rerun_mode
        self.check_nan = t.check_for_nan_in_loss_and_grad
        self.check_spiky = t.check_for_spiky_loss
        self.skip = set(t.iterations_to_skip or ())
        self.device, self.rank = device, rank
        self.tracker_file = t.result_rejected_tracker_filename
        self.inject_rate = t.error_injection_rate
        self.inject_type = t.error_injection_type
        self.inject_kind = t.error_injection_kind
        self.inject_at = set(t.error_injection_iterations or ())
        ranks = t.error_injection_ranks
        self.inject_here = ranks is None or not ranks or rank in ranks
        self._draws = random.Random(t.seed * 1009 + rank)  # the drills' own stream: training's untouched
        self.injected: set[int] = set()  # iterations a fault was injected at (first run)
        self.history = torch.zeros(SPIKE_WINDOW, dtype=torch.float32, device=device)
        self.accepted = torch.zeros((), dtype=torch.float32, device=device)
        self.poison: torch.Tensor | None = None  # the last queued step's rejection, for the next one
        # Made once: a tensor built from a host list on every step would be a pageable host-to-device
        # copy, which waits for the device (and the loop would lose its one step of lead).
        spike_weight = 0.0 if self.mode == "disabled" else 1.0
        self._weights = torch.tensor([1.0, spike_weight, 1.0, 1.0], device=device)
        self.skipped_in_a_row = 0
        self.last_applied = 0  # the last iteration whose update was kept (the trainer sets it)
        self.stats: dict[str, list[float]] = {"loss": [], "grad norm": []}
        self._hooks: list = []

    # ------------------------------------------------------------------ on the step, on the device
    @property
    def reruns(self) -> bool:
        return self.mode == "validate_results"

    def reject_flags(self, iteration: int, losses: dict, forced: bool) -> torch.Tensor:
        """``[non-finite loss, spike, forced, poisoned]`` of this rank (0-dim floats, one tensor) for
        the step; their sum is the optimizer's ``reject``. ``losses``: ``{name: tensor([sum, count])}``."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        loss_bad, spike = zero, zero
        main = main_loss(losses)
        if self.check_nan and losses:
            sums = torch.stack([v[0].float() for v in losses.values()])
            loss_bad = (~torch.isfinite(sums)).any().float()
        if self.check_spiky and main is not None:
            value = (main[0] / main[1].clamp(min=1)).float()
            ready = self.accepted >= SPIKE_WARMUP
            count = self.accepted.clamp(max=SPIKE_WINDOW).long()
            window = torch.where(
                torch.arange(SPIKE_WINDOW, device=self.device) < count, self.history, math.nan
            )
            reference = torch.nanmedian(window)
            spike = (ready & torch.isfinite(value) & (value > SPIKE_FACTOR * reference)).float()
        forced_t = torch.full((), float(forced), device=self.device)
        poisoned = self.poison.float() if self.poison is not None else zero
        return torch.stack([loss_bad, spike, forced_t, poisoned])

    def reject(self, flags: torch.Tensor) -> torch.Tensor:
        """The optimizer's reject flag from :meth:`reject_flags` (a spike rejects only where it is
        re-run or skipped: not with --rerun-mode disabled, where it is a warning)."""
        return (flags * self._weights).sum()

    def after_update(self, losses: dict, applied: Any) -> None:
        """Record an applied step's loss in the spike reference (on the device)."""
        if not self.check_spiky:
            return
        main = main_loss(losses)
        if main is None:
            return
        ok = applied if torch.is_tensor(applied) else torch.full((), bool(applied), device=self.device)
        value = (main[0] / main[1].clamp(min=1)).float()
        ok = ok & torch.isfinite(value)
        slot = (self.accepted % SPIKE_WINDOW).long()
        updated = self.history.scatter(0, slot.view(1), value.view(1))
        self.history = torch.where(ok, updated, self.history)
        self.accepted = self.accepted + ok.float()

    # ------------------------------------------------------------------ drills
    def arm(self, iteration: int, chunks: list, rerun: bool) -> None:
        """Inject the drill's fault into this step's model chunks, if it is due here."""
        self.disarm()
        if not self.inject_here or (rerun and self.inject_type not in REPRODUCED):
            return
        if rerun:
            due = iteration in self.injected
        else:
            due = iteration in self.inject_at
            if self.inject_rate > 0 and iteration > 1 and not self.inject_at:
                due = self._draws.randrange(self.inject_rate) == 0
            if due:
                self.injected.add(iteration)
        if not due:
            return
        spiky = self.inject_kind == "spiky_loss"
        for chunk in chunks:
            module = chunk.module if hasattr(chunk, "module") else chunk
            if spiky and not getattr(module, "post_process", True):
                continue
            # NaN gradients enter at the transformer stack's output (the loss fusion's backward wants
            # a well-formed gradient of the per-token losses); the spike scales the chunk's loss.
            target = module if spiky else getattr(module, "decoder", module)
            self._hooks.append(target.register_forward_hook(_spike if spiky else _poison))

    def disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ on the host
    def report(self, iteration: int, reasons: list[str], local: dict, run: str) -> str:
        """One line naming what was rejected where; ``local`` is this rank's view (gathered)."""
        views: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(views, local)
        else:
            views = [local]
        parts = []
        for v in views:
            found = []
            if v.get("loss_bad"):
                found.append("a NaN/Inf loss")
            if v.get("spike"):
                found.append(f"a loss spike ({v['spike']})")
            if v.get("param"):
                found.append(f"a NaN/Inf gradient first in {v['param']}")
            if found:
                parts.append(f"rank {v['rank']} (host {v['host']}, {v['device']}): {', '.join(found)}")
        where = "; ".join(parts) or "no rank found the fault in its own loss or gradients (reduced ones were)"
        which = "the first run" if run == "first" else "the re-run"
        line = f"iteration {iteration} rejected ({', '.join(reasons)}) in {which}: {where}"
        # A rejection in the re-run is the first run's fault reproduced.
        self.track(iteration, "initial_run" if run == "first" else "first_rerun_reproducible", line)
        return line

    def track(self, iteration: int, status: str, line: str) -> None:
        """Append Megatron's tracker line (``--result-rejected-tracker-filename``), on rank 0."""
        if self.tracker_file is None or self.rank != 0:
            return
        stamp = datetime.datetime.now()
        job = os.environ.get("SLURM_JOB_ID", "N/A")
        with open(self.tracker_file, "a") as f:
            f.write(
                f"ts={stamp} node={socket.gethostname()} device={self.device} jobID={job} rank={self.rank} "
                f"iteration={iteration} status={status} result=rejected message='{line}'\n"
            )

    def record_stats(self, first: tuple[float, float | None], second: tuple[float, float | None]) -> None:
        """``report_stats``: the relative difference of two runs' (loss, grad norm)."""
        for name, a, b in (("loss", first[0], second[0]), ("grad norm", first[1], second[1])):
            if a is None or b is None:
                continue
            self.stats[name].append(_relative_difference(a, b))

    def stats_line(self) -> str | None:
        if not any(self.stats.values()):
            return None
        parts = []
        for name, diffs in self.stats.items():
            if diffs:
                same = sum(d == 0.0 for d in diffs)
                parts.append(
                    f"{name}: {len(diffs)} re-runs, {same} identical, max rel. diff {max(diffs):.3E}"
                )
        self.stats = {k: [] for k in self.stats}
        return "rerun stats (--rerun-mode report_stats): " + "; ".join(parts)


def main_loss(losses: dict) -> Any:
    """The loss the checks judge: ``lm loss``, else the step's first; None when this rank has none
    (not the last pipeline stage)."""
    return losses.get("lm loss", next(iter(losses.values()), None))


def _relative_difference(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return _PoisonGrad.apply(output) if torch.is_tensor(output) else output


def _spike(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return output * SPIKE_INJECTION if torch.is_tensor(output) else output


def first_bad_param(chunks: list, norms: list) -> str | None:
    """The first parameter, in model order, whose local gradient norm in ``norms`` (``[(params,
    per-param norms tensor)]`` as DDP recorded them for one step) is NaN/Inf."""
    bad: set[int] = set()
    for params, values in norms:
        flags = (~torch.isfinite(values)).tolist()
        bad.update(id(p) for p, f in zip(params, flags) if f)
    if not bad:
        return None
    for i, chunk in enumerate(chunks):
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, p in module.named_parameters():
            if id(p) in bad:
                return f"{name} (model chunk {i})" if len(chunks) > 1 else name
    return "a parameter"
