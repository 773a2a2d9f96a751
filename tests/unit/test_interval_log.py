"""IntervalLog: the per-iteration time of a log line comes from the device's step-end events."""

from types import SimpleNamespace

import torch

from megatron.training.loop_utils import IntervalLog


class FakeEvent:
    """A CUDA event stand-in: ``t`` is the device time (ms) at which it was recorded."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.t - self.t


class Writer:
    def __init__(self):
        self.rows = []

    def log_scalars(self, scalars, iteration, consumed):
        self.rows.append((iteration, scalars))


def trainer(train_iters: int = 10):
    """The attributes of a Trainer that IntervalLog reads, writing to a Writer."""
    return SimpleNamespace(
        flops_per_step=1e12,
        world_size=1,
        global_batch_size=2,
        peak_tflops=None,
        cfg=SimpleNamespace(
            training=SimpleNamespace(seq_length=8), logger=SimpleNamespace(log_params_norm=False)
        ),
        state=SimpleNamespace(iteration=0, consumed_train_samples=0),
        train_iters=train_iters,
        writer=Writer(),
        device=torch.device("cpu"),
    )


def test_iteration_time_follows_device_events_not_host_read_times():
    tr = trainer()
    log = IntervalLog(tr)
    start = log.t0
    loss = {"lm loss": (2.0, 1.0)}
    # Device: steps end every 300 ms. Host: step 2 is read late (held back by the launch of step 3),
    # step 3 (the last) is read right when it ends.
    device_end = {1: 300.0, 2: 600.0, 3: 900.0}
    host_read = {1: start + 0.31, 2: start + 0.85, 3: start + 0.91}
    for it in (1, 2, 3):
        tr.state.iteration = it
        log.record(loss, True, 1.0, 1e-4, 1.0, host_read[it], None, FakeEvent(device_end[it]))
        log.flush()
    times = [s["iteration-time"] for _, s in tr.writer.rows]
    assert abs(times[0] - 0.31) < 1e-9  # first line: from start-up, host clock
    assert abs(times[1] - 0.3) < 1e-9 and abs(times[2] - 0.3) < 1e-9
    # Without events (CPU) the host times are used.
    tr2 = trainer()
    log2 = IntervalLog(tr2)
    start = log2.t0
    for it in (1, 2):
        tr2.state.iteration = it
        log2.record(loss, True, 1.0, 1e-4, 1.0, start + 0.5 * it)
        log2.flush()
    assert [round(s["iteration-time"], 9) for _, s in tr2.writer.rows] == [0.5, 0.5]


def test_events_average_over_the_steps_of_a_line():
    tr = trainer()
    log = IntervalLog(tr)
    loss = {"lm loss": (2.0, 1.0)}
    tr.state.iteration = 1
    log.record(loss, True, 1.0, 1e-4, 1.0, log.t0 + 1.0, None, FakeEvent(100.0))
    log.flush()
    for it, t in ((2, 300.0), (3, 500.0), (4, 700.0)):
        tr.state.iteration = it
        log.record(loss, True, 1.0, 1e-4, 1.0, log.t0 + 9.0, None, FakeEvent(t))
    log.flush()
    assert abs(tr.writer.rows[-1][1]["iteration-time"] - 0.2) < 1e-9


def test_a_ramp_line_shows_the_last_batch_and_averages_throughput_over_its_steps():
    tr = trainer()
    log = IntervalLog(tr)
    loss = {"lm loss": (2.0, 1.0)}
    for it, (batch, flops) in enumerate(((2, 1e12), (6, 3e12)), start=1):
        tr.state.iteration = it
        log.record(
            loss, True, 1.0, 1e-4, 1.0, log.t0 + 1.0 * it, None, None, global_batch_size=batch, flops=flops
        )
    log.flush()  # 2 steps in 2 s: 1 s per step, (2 + 6) / 2 samples and (1 + 3) / 2 TFLOP per step
    row = tr.writer.rows[-1][1]
    assert row["batch-size"] == 6
    assert abs(row["throughput"] - 2.0) < 1e-9 and abs(row["tokens-per-sec-per-gpu"] - 4 * 8) < 1e-9
