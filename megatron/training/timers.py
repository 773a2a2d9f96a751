"""Per-phase step timers: ``--timing-log-level``, ``--timing-log-option``, ``--log-timers-to-tensorboard``.

Every log interval, the last rank prints Megatron's block (``(min, max) time across ranks (ms):`` and one
line per timer, its name padded with dots to 48 characters), each figure the time per step of the
interval's steps. Level 1 times the step's phases:

* ``forward-backward``: the schedule (it contains the next four);
* ``batch-generator``: waiting for the data iterator (the data wait);
* ``all-grads-sync``: ``finalize_model_grads``: the wait for the gradient reduce-scatter / all-reduce
  not hidden behind the backward, then the tied-embedding and layer-norm reductions (exposed
  communication);
* ``pipeline-wait`` (pp > 1): the stage waiting for its neighbours' sends and receives (the bubble);
* ``optimizer``: the step, containing ``params-all-gather``: the wait for the previous step's weight
  broadcasts (``finish_param_sync``, exposed communication with --overlap-param-gather).

Level 2 adds ``forward-compute`` (the forward step function, data wait included) and splits the
pipeline wait into ``forward-recv`` (receiving an activation), ``backward-recv`` (a gradient) and
``pipeline-send`` (sends only).

Cost: level 0 builds nothing and each hook is one attribute read, no device sync. Levels 1 and 2
synchronise the device at every timer boundary, as Megatron's timers do, so the host no longer runs a
step ahead of the device (the loop's overlap of step k + 1's launch with step k's results is lost), and
gather one small tensor over all ranks per log line. Use them to find where time goes, not to measure
peak throughput.

Timings are kept per step (the loop queues step k + 1 before it logs step k): ``next_step`` opens a
step's record and ``report`` consumes those up to the logged iteration.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel import p2p_communication

# name -> the level that enables it, in the report's order.
TIMER_LEVELS = {
    "forward-backward": 1,
    "forward-compute": 2,
    "batch-generator": 1,
    "all-grads-sync": 1,
    "pipeline-wait": 1,
    "forward-recv": 2,
    "backward-recv": 2,
    "pipeline-send": 2,
    "optimizer": 1,
    "params-all-gather": 1,
}
OPTIONS = ("max", "minmax", "all")


class _NullTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


NULL_TIMER = _NullTimer()


class _Timer:
    """Host time between ``start`` and ``stop``, the device synchronised at both."""

    __slots__ = ("_begin", "name", "timers")

    def __init__(self, name: str, timers: Timers) -> None:
        self.name, self.timers, self._begin = name, timers, 0.0

    def start(self) -> None:
        self.timers.sync()
        self._begin = time.perf_counter()

    def stop(self) -> None:
        self.timers.sync()
        self.timers.add(self.name, time.perf_counter() - self._begin)


class Timers:
    """The run's timers: ``timers(name)`` is a timer with ``start`` / ``stop`` (one that does nothing
    when ``name`` is above the level or the level is 0)."""

    def __init__(self, level: int, option: str, device: torch.device) -> None:
        assert level in (0, 1, 2) and option in OPTIONS, (level, option)
        self.level, self.option, self.device = level, option, device
        self.names = [n for n, lv in TIMER_LEVELS.items() if lv <= level]
        self._timers = {n: _Timer(n, self) for n in self.names}
        self._steps: dict[int, dict[str, float]] = {}  # iteration -> {name: seconds}, oldest first
        self._current: dict[str, float] | None = None
        self.last = 0  # the last step started (build_timers: the loaded iteration)

    def __call__(self, name: str) -> _Timer | _NullTimer:
        return self._timers.get(name, NULL_TIMER)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def next_step(self, iteration: int = 0) -> None:
        """Step ``iteration`` (0: the one after the last) starts, or is run again: what the timers
        measure from now on is its."""
        if self.level:
            self.last = iteration or self.last + 1
            self._current = self._steps.setdefault(self.last, {})

    def add(self, name: str, seconds: float) -> None:
        if self._current is not None:
            self._current[name] = self._current.get(name, 0.0) + seconds

    def take(self, iteration: int, num_steps: int) -> list[float]:
        """This rank's seconds per step of each name over the steps up to ``iteration`` (``num_steps``
        of them), which are dropped (0.0: not timed here)."""
        totals = dict.fromkeys(self.names, 0.0)
        for it in [it for it in self._steps if it <= iteration]:
            step = self._steps.pop(it)
            for name, seconds in step.items():
                totals[name] += seconds
            if step is self._current:
                self._current = None  # an evaluation after this line is not a training step's
        return [totals[n] / max(num_steps, 1) for n in self.names]

    def report(self, iteration: int, num_steps: int) -> tuple[str | None, dict[str, float]]:
        """Every rank calls it at the log line of ``iteration`` (one all-gather): (the block the last
        rank prints, ``{name-time: the slowest rank's seconds per step}`` for the scalars); (None, {})
        at level 0."""
        if not self.level:
            return None, {}
        mine = torch.tensor(self.take(iteration, num_steps), dtype=torch.float64)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            gathered = [
                torch.zeros(len(self.names), dtype=torch.float64, device=device) for _ in range(world)
            ]
            dist.all_gather(gathered, mine.to(device))
            table = torch.stack(gathered).cpu()
        else:
            table = mine.view(1, -1)
        return format_timers(self.names, table, self.option), max_times(self.names, table)


def max_times(names: list[str], table: torch.Tensor) -> dict[str, float]:
    """``{name-time: the slowest rank's seconds}`` of the timers some rank ran (Megatron's scalars)."""
    out = {}
    for i, name in enumerate(names):
        column = table[:, i]
        if (column > 0).any():
            out[f"{name}-time"] = float(column.max())
    return out


def format_timers(names: list[str], table: torch.Tensor, option: str) -> str | None:
    """Megatron's timer block of ``table`` ([ranks, names], seconds per step); a timer no rank ran is
    left out (None: none ran)."""
    lines = []
    for i, name in enumerate(names):
        column = table[:, i] * 1000.0
        ran = column[column > 0]
        if ran.numel() == 0:
            continue
        label = (name + " ").ljust(48, ".")
        if option == "max":
            lines.append(f"    {label}: {float(ran.max()):.2f}")
        elif option == "minmax":
            lines.append(f"    {label}: ({float(ran.min()):.2f}, {float(ran.max()):.2f})")
        else:
            lines.append(f"  {name}:")
            lines += [f"     rank {r:2d}: {float(t):.2f}" for r, t in enumerate(column) if t > 0]
    if not lines:
        return None
    header = {
        "max": "max time across ranks (ms):",
        "minmax": "(min, max) time across ranks (ms):",
        "all": "times across ranks (ms):",
    }[option]
    return "\n".join([header, *lines])


# ------------------------------------------------------------------------------------------ the hooks
class TimedIterator:
    """A data iterator whose ``next`` is timed as ``batch-generator``; other attributes are the
    wrapped iterator's."""

    def __init__(self, inner: Iterator, timers: Timers) -> None:
        self.inner, self.timers = inner, timers

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        timer = self.timers("batch-generator")
        timer.start()
        try:
            return next(self.inner)
        finally:
            timer.stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _TimedProviders:
    """The trainer's providers with ``forward_step`` timed as ``forward-compute`` (training only)."""

    def __init__(self, inner: Any, timers: Timers) -> None:
        self._inner, self._timers = inner, timers

    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> Any:
        if not model.training:
            return self._inner.forward_step(data_iterator, model)
        timer = self._timers("forward-compute")
        timer.start()
        try:
            return self._inner.forward_step(data_iterator, model)
        finally:
            timer.stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def timed(timers: Timers, name: str, func: Callable) -> Callable:
    """``func`` timed as ``name``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        timer = timers(name)
        timer.start()
        try:
            return func(*args, **kwargs)
        finally:
            timer.stop()

    return run


# The pipeline's exchanges report to the timers of the run that has them (a weak reference: a run
# that ended stops timing); the wrapper is installed once per process.
_pipeline_timers: Callable[[], Timers | None] = lambda: None  # noqa: E731
_exchange_wait = p2p_communication.Exchange.wait


def _timed_exchange_wait(self: p2p_communication.Exchange) -> Any:
    timers = _pipeline_timers()
    if timers is None or not self.requests:
        return _exchange_wait(self)
    from_prev, from_next = self.received
    fine = (
        "backward-recv"
        if from_next is not None
        else "forward-recv"
        if from_prev is not None
        else "pipeline-send"
    )
    outer, inner = timers("pipeline-wait"), timers(fine)
    outer.start()
    inner.start()
    try:
        return _exchange_wait(self)
    finally:
        inner.stop()
        outer.stop()


def build_timers(trainer: Any) -> Timers:
    """The run's timers, hooked into ``trainer`` (its data iterator, forward step, gradient
    finalisation, optimizer and pipeline exchanges) when the level is above 0."""
    global _pipeline_timers
    lg = trainer.cfg.logger
    timers = Timers(lg.timing_log_level, lg.timing_log_option, trainer.device)
    timers.last = trainer.state.iteration
    _pipeline_timers = lambda: None  # noqa: E731
    if not timers.level:
        return timers
    it = trainer.train_iter
    if isinstance(it, list):  # virtual pipeline stages: one iterator per chunk
        trainer.train_iter = [TimedIterator(i, timers) if i is not None else None for i in it]
    elif it is not None:
        trainer.train_iter = TimedIterator(it, timers)
    if timers.level >= 2:
        trainer.providers = _TimedProviders(trainer.providers, timers)
    model_cfg = trainer.cfg.model
    if model_cfg.finalize_model_grads_func is not None:
        model_cfg.finalize_model_grads_func = timed(
            timers, "all-grads-sync", model_cfg.finalize_model_grads_func
        )
    for opt in getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]:
        opt.finish_param_sync = timed(timers, "params-all-gather", opt.finish_param_sync)
    if trainer.pg.pp_size > 1:
        ref = weakref.ref(timers)
        _pipeline_timers = ref
        p2p_communication.Exchange.wait = _timed_exchange_wait  # type: ignore[method-assign]
    return timers
