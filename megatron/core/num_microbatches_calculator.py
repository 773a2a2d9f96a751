"""How many micro-batches each optimizer step runs: the global batch size as a function of the
samples consumed so far.

The calculators themselves (constant, ramp-up and step schedules) and their schedule parsing live in
:mod:`megatron.core.microbatch_calculators`, re-exported here under their Megatron-Core names.

The trainer builds and holds its own calculator (:func:`build_num_microbatches_calculator`). The
module-level functions (``init_num_microbatches_calculator``, ``get_num_microbatches``, ...) are the
Megatron-Core entry points over a default instance, for user code written against them.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.core.config_utils import ConfigError
from megatron.core.microbatch_calculators import (
    ConstantNumMicroBatchesCalculator as ConstantNumMicroBatchesCalculator,
)
from megatron.core.microbatch_calculators import NumMicroBatchesCalculator as NumMicroBatchesCalculator
from megatron.core.microbatch_calculators import (
    RampupBatchsizeNumMicroBatchesCalculator as RampupBatchsizeNumMicroBatchesCalculator,
)
from megatron.core.microbatch_calculators import (
    StepBatchsizeNumMicroBatchesCalculator as StepBatchsizeNumMicroBatchesCalculator,
)
from megatron.core.microbatch_calculators import check_rampup as check_rampup
from megatron.core.microbatch_calculators import parse_count as parse_count
from megatron.core.microbatch_calculators import (
    parse_step_batch_size_schedule as parse_step_batch_size_schedule,
)
from megatron.core.runtime import get_runtime


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    data_parallel_size: int | None,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: str | None = None,
    seq_length: int | None = None,
    log: Callable[[str], None] | None = None,
) -> NumMicroBatchesCalculator:
    """The calculator for these settings (not recorded as the default; see the module docstring).

    ``step_batch_size_schedule`` wins over ``global_batch_size`` (its last batch is the final one);
    ``rampup_batch_size`` is ``[start, increment, ramp-up samples]``.

    Raises:
        ConfigError: both schedules given, a malformed one, or sizes that do not fit.
    """
    for name, value in (("micro_batch_size", micro_batch_size), ("data_parallel_size", data_parallel_size)):
        if value is None:
            raise ConfigError(f"{name} is required, e.g. {name}=1", params=(name,))
    assert micro_batch_size is not None and data_parallel_size is not None
    if step_batch_size_schedule is not None:
        if rampup_batch_size is not None:
            raise ConfigError(
                "step_batch_size_schedule and rampup_batch_size are exclusive; give one",
                params=("step_batch_size_schedule", "rampup_batch_size"),
            )
        return StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed,
            rank,
            step_batch_size_schedule,
            seq_length,
            log=log,
        )
    if global_batch_size is None:
        raise ConfigError(
            "global_batch_size is required without a step_batch_size_schedule",
            params=("global_batch_size", "step_batch_size_schedule"),
        )
    if rampup_batch_size is None:
        calc = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank, log
        )
        return calc
    if len(rampup_batch_size) != 3:
        raise ConfigError(
            f"rampup_batch_size takes 3 values (<start> <increment> <ramp-up samples>), got "
            f"{list(rampup_batch_size)}",
            params=("rampup_batch_size",),
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        rank,
        start,
        increment,
        samples,
        log=log,
    )


# ---------------------------------------------------------------------- the default instance
def _default() -> NumMicroBatchesCalculator:
    calculator = get_runtime().num_microbatches_calculator
    assert calculator is not None, "call init_num_microbatches_calculator first"
    return calculator


def set_num_microbatches_calculator(calculator: NumMicroBatchesCalculator | None) -> None:
    """Record ``calculator`` as the default instance (the trainer records the one it holds) in the
    runtime state (:class:`megatron.core.runtime.Runtime`)."""
    get_runtime().num_microbatches_calculator = calculator


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    data_parallel_size: int | None = None,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: str | None = None,
    seq_length: int | None = None,
) -> None:
    """Build the default calculator (arguments as :func:`build_num_microbatches_calculator`; the
    defaults are Megatron-Core's, ``micro_batch_size`` and ``data_parallel_size`` must be given).

    Raises:
        AssertionError: one is already initialized (``destroy_num_microbatches_calculator`` first).
    """
    assert get_runtime().num_microbatches_calculator is None, (
        "num microbatches calculator is already initialized"
    )
    reconfigure_num_microbatches_calculator(
        rank,
        rampup_batch_size,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        step_batch_size_schedule,
        seq_length,
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    data_parallel_size: int | None = None,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: str | None = None,
    seq_length: int | None = None,
) -> None:
    """Replace the default calculator."""
    set_num_microbatches_calculator(
        build_num_microbatches_calculator(
            rank,
            rampup_batch_size,
            global_batch_size,
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed,
            step_batch_size_schedule,
            seq_length,
        )
    )


def destroy_num_microbatches_calculator() -> None:
    set_num_microbatches_calculator(None)


unset_num_microbatches_calculator = destroy_num_microbatches_calculator


def get_num_microbatches() -> int:
    return _default().get()


def get_current_global_batch_size() -> int:
    return _default().get_current_global_batch_size()


def get_current_running_global_batch_size() -> int:
    return _default().get_current_running_global_batch_size()


def get_micro_batch_size() -> int:
    return _default().get_micro_batch_size()


def update_num_microbatches(
    consumed_samples: int, consistency_check: bool = True, verbose: bool = False
) -> None:
    _default().update(consumed_samples, consistency_check, verbose)
