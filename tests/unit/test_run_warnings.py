"""Issue 23: what a run says about NaN losses, loss spikes and a validation that cannot run."""

import math

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.cli import run
from megatron.training.loop_utils import IntervalLog, average_losses
from megatron.training.metrics import LossSpikeWatch
from tests.unit.test_interval_log import Writer, trainer

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 --vocab-size 128 "
    "--num-workers 0 --log-interval 1"
).split()


def log_lines(losses_per_line: list[list[float]]) -> Writer:
    """Each inner list is one log line's steps (the lm loss of each); returns what the writer got."""
    tr = trainer(train_iters=100)
    log = IntervalLog(tr)
    for steps in losses_per_line:
        for loss in steps:
            tr.state.iteration += 1
            log.record({"lm loss": (loss, 1.0)}, True, 1.0, 1e-4, 1.0, log.t0 + tr.state.iteration)
        log.flush()
    return tr.writer


# -------------------------------------------------------------------------------------------------- NaN
def test_a_taken_step_with_a_nan_loss_is_a_nan_iteration_and_stays_out_of_the_mean(capsys):
    """With --no-check-for-nan-in-loss-and-grad the line said 'number of nan iterations: 0' and lm loss NAN."""
    writer = log_lines([[2.0, float("nan"), 4.0], [float("inf"), float("nan")]])
    first, second = (row for _, row in writer.rows)
    assert first["nan-iterations"] == 1 and first["lm loss"] == 3.0  # the finite steps' mean
    assert second["nan-iterations"] == 2 and math.isnan(second["lm loss"])  # nothing finite: shown as NaN
    out = capsys.readouterr().out.splitlines()
    assert "lm loss: 3.000000E+00 |" in out[0] and "number of nan iterations:   1 |" in out[0]
    assert "lm loss: NAN |" in out[1] and "number of nan iterations:   2 |" in out[1]


def test_skipped_steps_count_as_nan_only_with_a_nan_loss_as_in_megatron():
    steps = [
        ({"lm loss": (float("nan"), 1.0)}, False),
        ({"lm loss": (5.0, 1.0)}, False),
        ({"lm loss": (6.0, 2.0), "z loss": (1.0, 2.0)}, True),
        ({"lm loss": (1.0, 1.0), "z loss": (math.inf, 1.0)}, True),
    ]
    avg, skipped, nan = average_losses(steps)
    assert (skipped, nan) == (2, 2) and avg == {"lm loss": 3.0, "z loss": 0.5}


def test_no_check_for_nan_run_counts_its_nan_iterations(capsys):
    argv = (
        TINY
        + (
            "--mock-data --train-iters 3 --lr 1e30 --lr-warmup-iters 0 --clip-grad 0 --eval-iters 0 "
            "--no-check-for-nan-in-loss-and-grad"
        ).split()
    )
    assert run(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "number of nan iterations" in ln]
    assert len(lines) == 3 and "number of nan iterations:   0 |" in lines[0]
    for line in lines[1:]:  # the step at lr 1e30 poisoned the weights
        assert "lm loss: NAN |" in line and "number of nan iterations:   1 |" in line


# ------------------------------------------------------------------------------------------- loss spikes
def test_a_loss_that_jumps_from_5_5_to_9800_is_named_once(capsys):
    log_lines([[5.5], [5.6], [5.4], [5.5], [9800.0, 9800.0], [5.5]])
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning")]
    assert warnings == [
        "warning: loss spike: lm loss 9.800000E+03 over iterations 5-6 is 1781.8x the median "
        "5.500000E+00 of the last 4 logged values; the run continues (check the data of those "
        "steps; a lower --lr or a --clip-grad helps against spikes)"
    ]


def test_no_spike_warning_on_noise_first_steps_small_losses_or_skipped_steps(capsys):
    rng = np.random.default_rng(0)
    noise = [[float(v)] for v in 3.0 * np.exp(rng.normal(0, 0.25, 200))]  # one-step lines: +-25% noise
    log_lines(noise)
    log_lines([[10.8], [9800.0]])  # the first lines: nothing to compare with yet
    log_lines([[0.01], [0.01], [0.01], [0.01], [0.09]])  # 9x a memorised batch's loss, but 0.08 nats
    log_lines([[11.0], [7.0], [4.0], [2.5], [2.2], [2.4], [2.1]])  # an ordinary start
    tr = trainer(train_iters=100)
    log = IntervalLog(tr)
    for it, (loss, ok) in enumerate([(5.5, True)] * 4 + [(9800.0, False)] * 3 + [(5.5, True)], start=1):
        tr.state.iteration = it  # fp16 overflow steps are skipped, their loss never shown
        log.record({"lm loss": (loss, 1.0)}, ok, 1.0, 1e-4, 1.0, log.t0 + it)
        log.flush()
    assert not [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning")]


def test_a_lasting_new_level_stops_warning():
    watch = LossSpikeWatch()
    said = [
        bool(watch.check(i, i, {"lm loss": v})) for i, v in enumerate([2.0] * 5 + [8.0] * 10 + [math.nan])
    ]
    assert said[:6] == [False] * 5 + [True] and not any(said[-5:])
    assert sum(said) <= LossSpikeWatch.WINDOW // 2  # until the new level is the median


# ------------------------------------------------------------------------------ empty validation split
def validation_run(argv: list[str], capsys) -> list[str]:
    assert run(TINY + argv + "--train-iters 4 --eval-interval 2 --eval-iters 2".split()) == 0
    out = capsys.readouterr().out.splitlines()
    assert not [ln for ln in out if "validation loss at iteration" in ln or "on validation set" in ln]
    assert [ln for ln in out if "iteration        4/       4" in ln]
    return [ln for ln in out if "validation split is empty" in ln]


def test_eval_interval_with_a_zero_validation_share_says_once_there_is_no_validation(capsys):
    assert validation_run(["--mock-data", "--split", "100,0,0"], capsys) == [
        " > validation split is empty (--split 100,0,0 gives it 0 of 100000 documents): no validation"
    ]


def write_dataset(prefix: str, docs: list[list[int]]) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_eval_interval_with_a_validation_blend_of_no_sample_says_once_there_is_no_validation(
    tmp_path, capsys
):
    rng = np.random.default_rng(0)
    train = write_dataset(str(tmp_path / "train"), [[*rng.integers(0, 127, 40), 127] for _ in range(300)])
    empty = write_dataset(str(tmp_path / "empty"), [])
    short = write_dataset(str(tmp_path / "short"), [[1, 2, 127]])
    data = f"--tokenizer-type NullTokenizer --train-data-path {train} --valid-data-path".split()
    assert validation_run(data + [empty], capsys) == [
        f" > validation split is empty (--valid-data-path gives it 0 of 0 documents of {empty}): no validation"
    ]
    assert validation_run(data + ["0.5", short, "0.5", empty], capsys) == [
        f" > validation split is empty (--valid-data-path gives it 1 of 1 documents of {short}, 3 tokens, fewer than "
        f"one sample of 33; 0 of 0 documents of {empty}): no validation"
    ]
