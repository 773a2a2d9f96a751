"""Batch-size schedules against hand-computed steps (Megatron's rules), and their errors."""

from __future__ import annotations

import pytest

from megatron.core import num_microbatches_calculator as nmc
from megatron.training.config import TrainingConfig


def steps(calc: nmc.NumMicroBatchesCalculator, n: int) -> list[tuple[int, int, int]]:
    """(consumed before, global batch size, micro-batches) of the first ``n`` steps."""
    out, consumed = [], 0
    for _ in range(n):
        calc.update(consumed, consistency_check=True)
        out.append((consumed, calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_running_global_batch_size()
    return out


def test_rampup_steps_and_iterations():
    # 8 -> 32 by 8: 3 increments over 90 samples, one every 30; micro-batch 2 x dp 2 = 4 samples.
    calc = nmc.build_num_microbatches_calculator(0, [8, 8, 90], 32, 2, 2)
    assert isinstance(calc, nmc.RampupBatchsizeNumMicroBatchesCalculator)
    assert steps(calc, 10) == [
        (0, 8, 2),
        (8, 8, 2),
        (16, 8, 2),
        (24, 8, 2),
        (32, 16, 4),
        (48, 16, 4),
        (64, 24, 6),
        (88, 24, 6),
        (112, 32, 8),
        (144, 32, 8),
    ]
    assert calc.global_batch_size_at(90) == 32 and calc.global_batch_size_at(89) == 24
    # 8 steps reach 112 samples, then (240 - 112) // 32 = 4 more; a last partial batch is dropped.
    assert calc.iterations_for_samples(240) == 12 and calc.iterations_for_samples(271) == 12
    assert calc.iterations_for_samples(50) == 5  # stops inside the ramp: 8+8+8+8+16 = 48
    assert calc.batch_sizes_from(0) == [8, 16, 24, 32] and calc.batch_sizes_from(64) == [24, 32]


def test_rampup_degenerate_and_errors():
    flat = nmc.build_num_microbatches_calculator(0, [16, 16, 1000], 16, 2, 2)  # nothing to ramp
    assert flat.global_batch_size_at(0) == 16 and flat.final_from() == 0
    with pytest.raises(ValueError, match="rampup_batch_size 8 5 90: global_batch_size 32 minus the start"):
        nmc.build_num_microbatches_calculator(0, [8, 5, 90], 32, 2, 2)
    with pytest.raises(ValueError, match="starts above global_batch_size"):
        nmc.build_num_microbatches_calculator(0, [64, 8, 90], 32, 2, 2)
    calc = nmc.build_num_microbatches_calculator(0, [2, 2, 90], 32, 2, 2)
    with pytest.raises(ValueError, match="global batch size 2 .* not divisible"):
        calc.update(0, consistency_check=True)


@pytest.mark.parametrize(
    "schedule,seq_length",
    [
        ("0:4 20:8 50:16", None),  # samples
        ("0:4 1.28K:8 3.2k:16", 64),
    ],
)  # tokens: 1280 / 64 = 20
def test_step_schedule_in_samples_and_tokens(schedule, seq_length):
    calc = nmc.build_num_microbatches_calculator(
        0, None, None, 2, 2, step_batch_size_schedule=schedule, seq_length=seq_length
    )
    assert calc.schedule == [(0, 4), (20, 8), (50, 16)] and calc.global_batch_size == 16
    got = steps(calc, 11)
    assert [b for _, b, _ in got] == [4] * 5 + [8] * 4 + [16] * 2  # the 8s run from 20 to 52
    assert got[9] == (52, 16, 4)
    assert calc.iterations_for_samples(100) == 9 + (100 - 52) // 16
    assert calc.batch_sizes_from(30) == [8, 16]


def test_step_schedule_of_the_gpt3_example():
    """examples/gpt3: thresholds in tokens of 2048 (2.4B tokens = 1171875 samples)."""
    text = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    parsed = nmc.parse_step_batch_size_schedule(text, 2048)
    assert parsed == [
        (0, 16),
        (1171875, 320),
        (2343750, 624),
        (3515625, 928),
        (4687500, 1232),
        (5859375, 1536),
    ]
    assert nmc.parse_count("2.4B") == 2_400_000_000 and nmc.parse_count("7.2b") == 7_200_000_000


@pytest.mark.parametrize(
    "schedule,message",
    [
        ("640:4 1280:8", "must start with a 0:BATCH entry"),
        ("0:4 10:8", "two entries fall at 0 samples"),  # 10 tokens < one 64-token sample
        ("0:4 2B", "is not THRESHOLD:BATCH"),
        ("0:4 x:8", "is not a count"),
        ("0:0", "batch sizes must be > 0"),
        ("", "is empty"),
    ],
)
def test_step_schedule_errors(schedule, message):
    with pytest.raises(ValueError, match=message):
        nmc.parse_step_batch_size_schedule(schedule, 64)


def test_training_config_rules():
    base = dict(micro_batch_size=2, seq_length=64)
    cfg = TrainingConfig(**base, train_iters=10, step_batch_size_schedule="0:4 1.28K:8")
    assert cfg.global_batch_size == 8  # the schedule's last batch
    TrainingConfig(**base, train_iters=10, global_batch_size=8, step_batch_size_schedule="0:4 1.28K:8")
    with pytest.raises(ValueError, match="--global-batch-size 16 differs from the last batch size"):
        TrainingConfig(**base, train_iters=10, global_batch_size=16, step_batch_size_schedule="0:4 1.28K:8")
    # With --train-iters, as Megatron-LM's gpt3 example passes it: that many steps, each at the ramp's size.
    assert (
        TrainingConfig(**base, train_iters=10, global_batch_size=8, rampup_batch_size=[4, 4, 100]).train_iters
        == 10
    )
    with pytest.raises(ValueError, match="takes 3 values"):
        TrainingConfig(**base, train_samples=10, global_batch_size=8, rampup_batch_size=[4, 4])
    with pytest.raises(ValueError, match="exclusive"):
        TrainingConfig(
            **base, train_samples=10, rampup_batch_size=[4, 4, 100], step_batch_size_schedule="0:4"
        )


def test_module_functions_use_the_default_instance():
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, [4, 4, 40], 12, 1, 2)
    try:
        assert nmc.get_num_microbatches() == 2 and nmc.get_current_global_batch_size() == 4
        nmc.update_num_microbatches(20)
        assert nmc.get_num_microbatches() == 4 and nmc.get_current_running_global_batch_size() == 8
        assert nmc.get_micro_batch_size() == 1
        with pytest.raises(AssertionError, match="already initialized"):
            nmc.init_num_microbatches_calculator(0, None, 12, 1, 2)
    finally:
        nmc.destroy_num_microbatches_calculator()
    constant = nmc.ConstantNumMicroBatchesCalculator(10, 1, 4, decrease_batch_size_if_needed=True)
    assert constant.get_current_running_global_batch_size() == 8 and constant.get() == 2
