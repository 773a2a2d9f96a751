"""A resume that proves itself, end to end: a run stopped half way (--exit-interval) and resumed prints
the resume block, and its batch fingerprints from the first step after the load are the uninterrupted
run's, resumed under one process with the model flags left to --use-checkpoint-args and another
micro-batch size, and under two data-parallel processes."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from launch import torchrun

from megatron.training import checkpointing
from megatron.training.cli import run

MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32"
RUN = (
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--train-iters 6 --log-batch-fingerprint"
).split()
FINGERPRINT = re.compile(r"batch fingerprint at iteration (\d+): ([0-9a-f]{16})")  # ranks share stdout


def _run(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run(args) == 0
    return out.getvalue()


def fingerprints(text: str) -> dict[int, str]:
    return {int(it): h for it, h in FINGERPRINT.findall(text)}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """(the straight run's fingerprints, the checkpoint of the run stopped after 3 of its 6 steps)."""
    ck = tmp_path_factory.mktemp("resume_proof") / "ck"
    straight = fingerprints(_run(MODEL.split() + RUN))
    half = _run(MODEL.split() + RUN + f"--save {ck} --save-interval 3 --exit-interval 3".split())
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and len(set(straight.values())) == 6
    assert fingerprints(half) == {it: straight[it] for it in (1, 2, 3)}
    return straight, ck


def test_resumed_run_prints_the_block_and_the_straight_runs_fingerprints(stopped):
    straight, ck = stopped
    text = _run(RUN + f"--load {ck} --use-checkpoint-args --micro-batch-size 1 --lr 3e-3".split())
    start = text.index(f"resuming from {ck}/iter_0000003")
    block = text[start:].splitlines()[:5]
    assert block == [
        f"resuming from {ck}/iter_0000003: iteration 3, consumed samples 12 (valid 0)",
        "  layout      tp1 pp1 dp1 (1 rank), as saved",
        "  flags that differ (1):",
        "    --micro-batch-size: 2 -> 1 (allowed: same global batch)",
        "  successfully loaded checkpoint from " + str(ck) + " at iteration 3",
    ]
    assert f"  next batch (iteration 4): fingerprint {straight[4]}" in text
    assert fingerprints(text) == {it: straight[it] for it in (4, 5, 6)}
    assert "note: --use-checkpoint-args: " in text and "--num-layers 2 --hidden-size 32" in text


@pytest.mark.slow
def test_resumed_under_two_data_parallel_ranks_reads_the_same_batches(stopped):
    straight, ck = stopped
    res = torchrun(2, MODEL.split() + RUN + f"--load {ck} --micro-batch-size 1".split(), timeout=300)
    assert "  layout      checkpoint tp1 pp1 dp1 (1 rank)   now tp1 pp1 dp2 (2 ranks)" in res.stdout
    assert fingerprints(res.stdout) == {it: straight[it] for it in (4, 5, 6)}, res.stdout[-3000:]


def test_a_schedule_change_is_refused_before_any_tensor_is_read(stopped, monkeypatch, capsys):
    _, ck = stopped

    def no_read(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(checkpointing.dist_checkpointing, "load", no_read)
    assert run(MODEL.split() + RUN + f"--load {ck} --lr 1e-3".split()) == 2
    out, err = capsys.readouterr()
    assert "    --lr: 0.003 -> 0.001 (refused: the checkpoint's schedule holds another value" in out
    assert "--lr: this run's value (0.001) differs from the checkpoint's (0.003)" in err
    assert "Traceback" not in err
