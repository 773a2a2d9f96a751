"""--timing-log-level's timers (megatron.training.timers) and the log line's fields (metrics.line_fields)."""

import torch

from megatron.training.metrics import line_fields
from megatron.training.timers import NULL_TIMER, TIMER_LEVELS, Timers, format_timers, max_times


def test_megatrons_block_in_each_option():
    table = torch.tensor(
        [[0.0105, 0.0, 0.002], [0.0123, 0.0, 0.001]], dtype=torch.float64
    )  # [ranks, names] s/step
    names = ["forward-backward", "pipeline-wait", "optimizer"]
    assert format_timers(names, table, "minmax") == (
        "(min, max) time across ranks (ms):\n"
        f"    {'forward-backward '.ljust(48, '.')}: (10.50, 12.30)\n"
        f"    {'optimizer '.ljust(48, '.')}: (1.00, 2.00)"
    )  # a timer no rank ran is left out
    assert (
        format_timers(names, table, "max").splitlines()[1]
        == f"    {'forward-backward '.ljust(48, '.')}: 12.30"
    )
    assert format_timers(names, table, "all").splitlines()[:4] == [
        "times across ranks (ms):",
        "  forward-backward:",
        "     rank  0: 10.50",
        "     rank  1: 12.30",
    ]
    assert max_times(names, table) == {"forward-backward-time": 0.0123, "optimizer-time": 0.002}
    assert format_timers(names, torch.zeros(2, 3), "minmax") is None


def test_level_0_times_nothing_and_a_level_enables_its_names():
    off = Timers(0, "minmax", torch.device("cpu"))
    assert off("forward-backward") is NULL_TIMER and off.names == []
    off.next_step(1)
    assert off.report(1, 1) == (None, {})
    one = Timers(1, "minmax", torch.device("cpu"))
    assert (
        one.names == [n for n, lv in TIMER_LEVELS.items() if lv == 1] and one("forward-compute") is NULL_TIMER
    )
    assert Timers(2, "max", torch.device("cpu")).names == list(TIMER_LEVELS)


def test_each_step_keeps_its_own_time_though_the_next_one_is_queued_first():
    timers = Timers(1, "minmax", torch.device("cpu"))
    timers.last = 10  # resumed at iteration 10
    timers.next_step()  # step 11
    timers.add("optimizer", 1.0)
    timers.next_step()  # step 12 is queued before step 11 is logged
    timers.add("optimizer", 3.0)
    assert timers.take(11, 1)[timers.names.index("optimizer")] == 1.0
    timers.next_step(12)  # step 12 run again (a re-run): its time adds to step 12's
    timers.add("optimizer", 1.0)
    timers.add("forward-backward", 2.0)
    values = dict(zip(timers.names, timers.take(12, 1)))
    assert values["optimizer"] == 4.0 and values["forward-backward"] == 2.0
    timers.add("optimizer", 5.0)  # after the last step's line (an evaluation): no step's
    assert timers.take(13, 1) == [0.0] * len(timers.names)


def test_the_line_shows_every_value_of_the_record():
    record = {
        "consumed-samples": 8,
        "iteration-time": 0.0321,
        "throughput": 0.5,
        "tokens-per-sec-per-gpu": 1000.0,
        "learning-rate": 3e-4,
        "batch-size": 4,
        "lm loss": 2.5,
        "z_loss": 0.01,
        "expert_load_imbalance": 1.25,
        "expert_load_imbalance_max": 1.5,
        "moe/z_loss_layer_1": 0.01,
        "loss-scale": 1.0,
        "grad-norm": 0.75,
        "skipped-iterations": 0,
        "nan-iterations": 0,
        "consumed-tokens": 256,
        "mem-host-max-rss-bytes": 3 * 2**20,
        "optimizer-time": 0.01,
    }
    fields = line_fields(record)
    assert [label for _, label, _ in fields][:6] == [
        "consumed samples",
        "elapsed time per iteration (ms)",
        "throughput per GPU (TFLOP/s/GPU)",
        "tokens per second per GPU",
        "MFU",
        "learning rate",
    ]
    texts = {key: text for key, _, text in fields}
    assert texts["iteration-time"] == "32.1" and texts["mfu"] == "n/a" and texts["lm loss"] == "2.500000E+00"
    assert texts["expert_load_imbalance"] == "1.250 (worst layer 1.500)" and texts["z_loss"] == "1.000000E-02"
    assert texts["mem-host-max-rss-bytes"] == "3.0" and texts["consumed-tokens"] == "256"
    # Everything but the per-layer MoE values and the timers (the timer block's) is on the line.
    assert set(record) - set(texts) == {"expert_load_imbalance_max", "moe/z_loss_layer_1", "optimizer-time"}
