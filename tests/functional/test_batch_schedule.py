"""Batch-size ramps, --decoupled-lr and --skip-train through pretrain_gpt.py on the CPU."""

import os

import pytest
from launch import metrics, torchrun

from megatron.training import checkpointing
from megatron.training.cli import run

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--lr 3e-3 --min-lr 3e-4 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1"
).split()
# 2 -> 8 by 2 over 12 samples (one increment every 4): steps of 2, 2, 4, 6, then 8; 10 steps fit in 64.
RAMP = (
    MODEL
    + (
        "--micro-batch-size 2 --global-batch-size 8 --rampup-batch-size 2 2 12 --train-samples 64 "
        "--lr-warmup-samples 8 --lr-decay-style cosine --eval-iters 1"
    ).split()
)
RAMP_BATCHES = [2, 2, 4, 6, 8, 8, 8, 8, 8, 8]


def records(path: str) -> dict[int, dict]:
    return metrics(path, "lm loss")


@pytest.mark.slow
def test_ramp_logs_each_step_and_resumes_mid_ramp_bitwise(tmp_path, capsys):
    assert run(RAMP + f"--metrics-file {tmp_path}/straight.jsonl".split()) == 0
    out = capsys.readouterr().out
    straight = records(f"{tmp_path}/straight.jsonl")
    assert [straight[i]["batch-size"] for i in sorted(straight)] == RAMP_BATCHES
    consumed = [sum(RAMP_BATCHES[:i]) for i in range(1, 11)]
    assert [straight[i]["consumed_samples"] for i in sorted(straight)] == consumed
    line = next(ln for ln in out.splitlines() if "iteration        4/      10" in ln)
    assert "consumed samples:           14" in line and "global batch size:     6" in line
    # The LR schedule counts samples: 8 warm-up samples end with step 3 (2 + 2 + 4).
    assert straight[3]["learning-rate"] == pytest.approx(3e-3) and straight[1][
        "learning-rate"
    ] == pytest.approx(7.5e-4)

    ck = tmp_path / "ck"  # saved after step 3 (8 samples), where the batch is about to grow to 6
    assert (
        run(
            RAMP
            + f"--save {ck} --save-interval 3 --exit-interval 3 --metrics-file {tmp_path}/r.jsonl".split()
        )
        == 0
    )
    assert checkpointing.read_tracker(str(ck)) == 3
    assert run(RAMP + f"--load {ck} --metrics-file {tmp_path}/r.jsonl".split()) == 0
    assert "global batch size 6 at 8 consumed samples" in capsys.readouterr().out
    resumed = records(f"{tmp_path}/r.jsonl")
    assert sorted(resumed) == list(range(1, 11))
    for it in straight:  # bitwise: floats compared exactly
        assert (resumed[it]["lm loss"], resumed[it]["batch-size"]) == (
            straight[it]["lm loss"],
            straight[it]["batch-size"],
        )


def lr_at(samples: int, peak: float, floor: float) -> float:
    """Linear decay over 6 iterations x 4 (the final batch) = 24 samples after a 4-sample warm-up."""
    if samples <= 4:
        return peak * samples / 4
    return floor + (peak - floor) * (1 - (samples - 4) / 20)


@pytest.mark.slow
def test_step_schedule_and_decoupled_lr_match_under_dp2_with_the_distributed_optimizer(tmp_path):
    """The gpt3 example's form (--global-batch-size equal to the schedule's last batch, --train-iters):
    "0:2 256:4" in tokens of 32 = 2 samples a step up to 8 consumed samples, then 4."""
    args = MODEL + [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--step-batch-size-schedule",
        "0:2 256:4",
        *(
            "--train-iters 6 --lr-warmup-iters 1 --lr-decay-style linear --decoupled-lr 1e-3 "
            "--decoupled-min-lr 1e-4 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0"
        ).split(),
    ]
    assert run(args + f"--metrics-file {tmp_path}/one.jsonl".split()) == 0
    torchrun(2, args + f"--use-distributed-optimizer --metrics-file {tmp_path}/dp2.jsonl".split())
    one, dp2 = records(f"{tmp_path}/one.jsonl"), records(f"{tmp_path}/dp2.jsonl")
    assert sorted(one) == sorted(dp2) == list(range(1, 7))
    samples = 0
    for it, batch in zip(range(1, 7), [2, 2, 2, 2, 4, 4]):
        samples += batch
        for rec in (one[it], dp2[it]):
            assert rec["batch-size"] == batch and rec["consumed_samples"] == samples
            assert rec["learning-rate"] == pytest.approx(lr_at(samples, 3e-3, 3e-4), rel=1e-9)
            assert rec["decoupled-learning-rate"] == pytest.approx(lr_at(samples, 1e-3, 1e-4), rel=1e-9)
        assert dp2[it]["lm loss"] == pytest.approx(one[it]["lm loss"], rel=2e-5), it


def validation_lines(out: str, iteration: int) -> list[str]:
    return [ln for ln in out.splitlines() if f"iteration {iteration} on " in ln]


@pytest.mark.slow
def test_skip_train_loads_and_evaluates_without_training(tmp_path, capsys):
    ck = tmp_path / "ck"
    base = MODEL + "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --eval-iters 2".split()
    assert run(base + f"--save {ck}".split()) == 0
    trained = validation_lines(capsys.readouterr().out, 4)
    assert len(trained) == 2  # validation and test, after the save
    assert run(base + f"--save {ck} --load {ck} --skip-train --metrics-file {tmp_path}/m.jsonl".split()) == 0
    out = capsys.readouterr().out
    assert "skipping training (--skip-train is on) at iteration 4" in out
    assert "iteration        " not in out and "saving checkpoint" not in out  # no step, no save
    # The same model on the same validation and test batches as the end of training.
    assert validation_lines(out, 4) == trained
    assert checkpointing.read_tracker(str(ck)) == 4
    assert [d for d in os.listdir(ck) if d.startswith("iter_")] == ["iter_0000004"]
