"""The micro-batch calculators: the global batch size as a function of the samples consumed so far,
and how many micro-batches each optimizer step runs.

Three schedules, with Megatron-Core's class names:

- :class:`ConstantNumMicroBatchesCalculator`: one global batch size throughout;
- :class:`RampupBatchsizeNumMicroBatchesCalculator` (``--rampup-batch-size start incr samples``):
  the batch grows from ``start`` by ``incr`` in ``(global - start) / incr`` equal intervals of
  consumed samples, reaching ``global`` after ``samples`` samples;
- :class:`StepBatchsizeNumMicroBatchesCalculator` (``--step-batch-size-schedule "0:16 2.4B:320"``):
  the batch is the one of the last ``threshold:batch`` entry whose threshold has been consumed.

Invariant: each calculator is a pure function of the consumed sample count (``global_batch_size_at``),
so a run resumed from a checkpoint's consumed samples continues the schedule exactly. ``update``
caches the value for one count, which the ``get*`` methods read.

This module holds no runtime state; :mod:`megatron.core.num_microbatches_calculator` builds a
calculator from settings, keeps the default instance, and re-exports every name defined here.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from megatron.core.config_utils import ConfigError

# The public module's name: users configure rank 0's schedule messages under it.
logger = logging.getLogger("megatron.core.num_microbatches_calculator")

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class NumMicroBatchesCalculator(ABC):
    """The global batch size at each consumed-sample count and the micro-batches it takes.

    Args:
        global_batch_size: the batch size the schedule ends at (``--global-batch-size``).
        micro_batch_size: samples per micro-batch per data-parallel rank.
        data_parallel_size: data-parallel ranks.
        decrease_batch_size_if_needed: round a batch size that ``micro_batch_size x
            data_parallel_size`` does not divide down to a multiple of it (the *running* batch size)
            instead of raising.
        rank: global rank; only rank 0 logs.
        log: where rank 0's messages go; default this module's ``logging`` logger.

    Raises:
        ConfigError: a size is not positive.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool = False,
        rank: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("data_parallel_size", data_parallel_size),
        ):
            if int(value) <= 0:
                raise ConfigError(f"{name} must be > 0 (e.g. 1), got {value}", params=(name,))
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_size = int(data_parallel_size)
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.log = log or logger.info
        self.num_micro_batches: int | None = None
        self.current_global_batch_size: int | None = None
        self.current_running_global_batch_size: int | None = None

    # ------------------------------------------------------------------ the schedule
    @abstractmethod
    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after ``consumed_samples`` samples."""

    @abstractmethod
    def final_from(self) -> int:
        """A consumed-sample count from which the batch size is ``global_batch_size`` for good."""

    @abstractmethod
    def batch_sizes_from(self, consumed_samples: int) -> list[int]:
        """Every batch size the schedule may still use from ``consumed_samples`` on."""

    def running_batch_size(self, global_batch_size: int) -> int:
        """The batch a step actually runs: ``global_batch_size``, or with
        ``decrease_batch_size_if_needed`` its largest multiple of ``micro_batch_size x dp``."""
        if not self.decrease_batch_size_if_needed:
            return global_batch_size
        m = self.micro_batch_times_data_parallel_size
        return global_batch_size // m * m

    def iterations_for_samples(self, train_samples: int) -> int:
        """Steps of a ``--train-samples`` run: steps are taken while the next one fits in
        ``train_samples`` (a last partial batch is dropped), the ramp counted step by step, as
        Megatron's ``update_train_iters`` does."""
        consumed = iterations = 0
        while consumed < self.final_from():
            step = self.running_batch_size(self.global_batch_size_at(consumed))
            if step <= 0 or consumed + step > train_samples:
                return iterations
            consumed += step
            iterations += 1
        final = self.running_batch_size(self.global_batch_size)
        return iterations + (train_samples - consumed) // final if final > 0 else iterations

    # ------------------------------------------------------------------ Megatron-Core's interface
    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """Set the current batch size and micro-batch count for ``consumed_samples``.

        Raises:
            ConfigError: with ``consistency_check``, ``micro_batch_size x data_parallel_size`` does not
                divide the batch size (and it may not be decreased).
        """
        previous = self.current_global_batch_size
        current = self.global_batch_size_at(consumed_samples)
        m = self.micro_batch_times_data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed and current % m:
            raise ConfigError(
                f"global batch size {current} (at {consumed_samples} consumed samples) is not divisible "
                f"by micro_batch_size {self.micro_batch_size} x data_parallel_size "
                f"{self.data_parallel_size}; choose a global_batch_size that is a multiple of "
                f"{m}",
                params=("global_batch_size", "micro_batch_size", "data_parallel_size"),
            )
        self.current_global_batch_size = current
        self.current_running_global_batch_size = self.running_batch_size(current)
        self.num_micro_batches = self.current_running_global_batch_size // m
        if verbose and self.rank == 0 and previous != current:
            count = f"{self.num_micro_batches} micro-batch{'es' if self.num_micro_batches != 1 else ''}"
            if previous is None:
                self.log(f"setting the global batch size to {current} ({count})")
            else:
                self.log(
                    f"global batch size {previous} -> {current} ({count}) from {consumed_samples} consumed "
                    "samples on"
                )

    def get(self) -> int:
        """Micro-batches of the current step."""
        assert self.num_micro_batches is not None, "call update(consumed_samples) first"
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        assert self.current_global_batch_size is not None, "call update(consumed_samples) first"
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        assert self.current_running_global_batch_size is not None, "call update(consumed_samples) first"
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """``global_batch_size`` at every step.

    Raises:
        ConfigError: ``micro_batch_size x data_parallel_size`` does not divide it (and it may not be
            decreased), or no micro-batch would be left.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool = False,
        rank: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank, log
        )
        self.update(0, consistency_check=True)
        if self.get() < 1:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is smaller than micro_batch_size "
                f"{micro_batch_size} x data_parallel_size {data_parallel_size}",
                params=("global_batch_size", "micro_batch_size", "data_parallel_size"),
            )

    def global_batch_size_at(self, consumed_samples: int) -> int:
        return self.global_batch_size

    def final_from(self) -> int:
        return 0

    def batch_sizes_from(self, consumed_samples: int) -> list[int]:
        return [self.global_batch_size]


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Linear ramp: ``start_global_batch_size + k * batch_size_increment`` after ``k`` of the
    ``(global - start) / increment`` equal intervals of ``ramup_samples / increments`` consumed
    samples; ``global_batch_size`` once more than ``ramup_samples`` samples are consumed.

    The interval index is ``int(consumed / (ramup_samples / increments))`` in floating point, as in
    Megatron, so every run of the same flags (and every resume) steps at the same samples.

    Raises:
        ConfigError: a non-positive start or increment, negative ramp samples, a start above
            ``global_batch_size``, or a difference the increment does not divide.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
        log: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank, log
        )
        self.start_global_batch_size = int(start_global_batch_size)
        self.batch_size_increment = int(batch_size_increment)
        self.ramup_samples = int(ramup_samples)
        check_rampup(
            self.start_global_batch_size,
            self.batch_size_increment,
            self.ramup_samples,
            self.global_batch_size,
        )
        self.num_increments = (
            self.global_batch_size - self.start_global_batch_size
        ) // self.batch_size_increment
        # No interval to ramp over (start == global, or 0 samples): the final batch throughout.
        self.rampup_samples_per_increment = (
            self.ramup_samples / self.num_increments if self.num_increments and self.ramup_samples else None
        )
        self.update(0, consistency_check=False)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        per = self.rampup_samples_per_increment
        if per is None or consumed_samples > self.ramup_samples:
            return self.global_batch_size
        steps = min(int(consumed_samples / per), self.num_increments)
        return self.start_global_batch_size + steps * self.batch_size_increment

    def final_from(self) -> int:
        return self.ramup_samples + 1 if self.rampup_samples_per_increment is not None else 0

    def batch_sizes_from(self, consumed_samples: int) -> list[int]:
        return list(
            range(
                self.global_batch_size_at(consumed_samples),
                self.global_batch_size + 1,
                self.batch_size_increment,
            )
        )


def check_rampup(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> None:
    """The rules of ``rampup_batch_size = [start, incr, samples]`` against ``global_batch_size``.

    Raises:
        ConfigError: naming the parameters and a valid value.
    """
    params = ("rampup_batch_size", "global_batch_size")
    if start <= 0 or increment <= 0 or ramp_samples < 0:
        raise ConfigError(
            f"rampup_batch_size {start} {increment} {ramp_samples}: the start and increment must "
            "be > 0 and the ramp-up samples >= 0 (e.g. rampup_batch_size 16 16 5859375)",
            params=params[:1],
        )
    flag = f"rampup_batch_size {start} {increment} {ramp_samples}"
    diff = global_batch_size - start
    if diff < 0:
        raise ConfigError(
            f"{flag} starts above global_batch_size {global_batch_size}; start at or below it", params=params
        )
    if diff % increment:
        raise ConfigError(
            f"{flag}: global_batch_size {global_batch_size} minus the start ({diff}) is not a multiple "
            f"of the increment; e.g. rampup_batch_size {start} {_divisor_near(diff, increment)} "
            f"{ramp_samples}",
            params=params,
        )


def _divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` closest to ``target`` (an increment suggestion)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Piecewise-constant schedule ``"THRESHOLD:BATCH THRESHOLD:BATCH ..."``.

    Thresholds and batch sizes take K/M/B/T suffixes (10^3 ... 10^12); entries are separated by
    spaces or commas. With ``seq_length`` the thresholds count tokens and become samples by integer
    division (``2.4B`` tokens at 2048 tokens a sample = 1171875 samples); without it they count
    samples. The step after ``c`` consumed samples uses the batch of the last entry whose threshold is
    ``<= c``; the last entry's batch is ``global_batch_size``.

    Divisibility by ``micro_batch_size x data_parallel_size`` is checked by :meth:`update` for the
    batch in use only: entries passed before a resume on more ranks may not divide the new layout.

    Raises:
        ConfigError: a malformed entry, no entry at threshold 0, thresholds (in samples) not strictly
            increasing, a non-positive batch size, or ``decrease_batch_size_if_needed``.
    """

    def __init__(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        schedule: str,
        seq_length: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if decrease_batch_size_if_needed:
            raise ConfigError(
                "step_batch_size_schedule cannot be combined with decrease_batch_size_if_needed",
                params=("step_batch_size_schedule", "decrease_batch_size_if_needed"),
            )
        self.schedule = parse_step_batch_size_schedule(schedule, seq_length)
        super().__init__(self.schedule[-1][1], micro_batch_size, data_parallel_size, False, rank, log)
        self.seq_length = seq_length
        self.update(0, consistency_check=False)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        batch = self.schedule[0][1]
        for threshold, size in self.schedule:
            if consumed_samples < threshold:
                break
            batch = size
        return batch

    def final_from(self) -> int:
        return self.schedule[-1][0]

    def batch_sizes_from(self, consumed_samples: int) -> list[int]:
        return [self.global_batch_size_at(consumed_samples)] + [
            b for t, b in self.schedule if t > consumed_samples
        ]

    def iterations_for_samples(self, train_samples: int) -> int:
        """As the base class's step-by-step count, a stretch of equal steps at a time."""
        consumed = iterations = 0
        while True:
            batch = self.global_batch_size_at(consumed)
            fit = max(train_samples - consumed, 0) // batch  # steps of this size that still fit
            later = [t for t, _ in self.schedule if t > consumed]
            if not later:
                return iterations + fit
            crossing = -(-(later[0] - consumed) // batch)  # steps until the next threshold is reached
            if fit < crossing:
                return iterations + fit
            iterations += crossing
            consumed += crossing * batch


def parse_count(text: str) -> int:
    """``"2.4B"`` -> 2400000000: a non-negative count with an optional K/M/B/T suffix, exactly.

    Raises:
        ValueError: not a number, or negative.
    """
    body = text.strip().upper()
    scale = _SUFFIXES.get(body[-1:], 1)
    if scale != 1:
        body = body[:-1]
    try:
        value = Decimal(body) * scale
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a count (a number with an optional K, M, B or T suffix)") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{text!r} is not a count >= 0")
    return int(value)


def parse_step_batch_size_schedule(schedule: str, seq_length: int | None = None) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(threshold in samples, batch size), ...]``, sorted by threshold.

    Raises:
        ConfigError: naming ``step_batch_size_schedule`` and what is wrong.
    """
    flag = f"step_batch_size_schedule {schedule!r}"
    params = ("step_batch_size_schedule",)
    entries = schedule.replace(",", " ").split()
    if not entries:
        raise ConfigError(
            f"{flag} is empty; give 'THRESHOLD:BATCH' entries, e.g. \"0:16 2.4B:320\"", params=params
        )
    parsed = []
    for entry in entries:
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ConfigError(
                f"{flag}: entry {entry!r} is not THRESHOLD:BATCH (e.g. 2.4B:320)", params=params
            )
        try:
            t, b = parse_count(threshold), parse_count(batch)
        except ValueError as e:
            raise ConfigError(f"{flag}: entry {entry!r}: {e}", params=params) from None
        if b <= 0:
            raise ConfigError(
                f"{flag}: entry {entry!r} has batch size {b}; batch sizes must be > 0", params=params
            )
        parsed.append((t // seq_length if seq_length else t, b))
    parsed.sort(key=lambda e: e[0])
    unit = f"samples ({seq_length} tokens each)" if seq_length else "samples"
    if parsed[0][0] != 0:
        raise ConfigError(
            f"{flag}: the first threshold is {parsed[0][0]} {unit}; the schedule must start with a "
            "0:BATCH entry",
            params=params,
        )
    for (t0, _), (t1, _) in zip(parsed, parsed[1:]):
        if t1 == t0:
            raise ConfigError(
                f"{flag}: two entries fall at {t0} {unit}; thresholds must be strictly increasing",
                params=params,
            )
    return parsed
