"""Bad steps end to end (megatron.training.rerun): a NaN injected into one rank's gradients or a loss
spike, at a chosen step, is caught before the update, named, re-run in place and kept (transient) or
skipped (reproduced) exactly as a run that skipped that batch; --rerun-mode disabled and a second
bad step in a row stop the run (exit 3) with the model untouched."""

from __future__ import annotations

import math
import re

from launch import metrics, torchrun_many

from megatron.training.cli import run

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0"
).split()
TINY = BASE + ["--train-iters", "9"]
NAN = "--error-injection-iterations 4 --error-injection-ranks 1".split()
SPIKE = "--check-for-spiky-loss --error-injection-kind spiky_loss --error-injection-iterations 7 --error-injection-ranks 1"


def _counters(out: str) -> dict[int, tuple[int, int]]:
    """Iteration -> (skipped, nan iterations) from the log lines."""
    found = {}
    for m in re.finditer(
        r"iteration +(\d+)/.*?number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+)", out
    ):
        found[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return found


def _losses(path) -> dict[int, float]:
    return {it: r["lm loss"] for it, r in metrics(str(path), "lm loss").items()}


def test_injected_faults_are_named_rerun_and_kept_or_skipped(tmp_path):
    names = [
        "clean",
        "transient",
        "persistent",
        "skip4",
        "spike",
        "skip7",
        "stats",
        "pp-persistent",
        "pp-skip4",
    ]
    extra = {
        "clean": [],
        "transient": NAN + [f"--result-rejected-tracker-filename={tmp_path}/rejected.txt"],
        "persistent": NAN
        + [
            "--error-injection-type",
            "persistent_error",
            f"--result-rejected-tracker-filename={tmp_path}/kept.txt",
        ],
        "skip4": ["--iterations-to-skip", "4"],
        "spike": SPIKE.split() + ["--error-injection-type", "persistent_error"],
        "skip7": ["--iterations-to-skip", "7"],
        "stats": ["--rerun-mode", "report_stats"],
        # Two pipeline stages: the NaN arises on the first stage (rank 0), the loss lives on the second.
        "pp-persistent": "--pipeline-model-parallel-size 2 --error-injection-iterations 4 --error-injection-ranks 0 "
        "--error-injection-type persistent_error".split(),
        "pp-skip4": "--pipeline-model-parallel-size 2 --iterations-to-skip 4".split(),
    }
    runs = [TINY + extra[n] + ["--metrics-file", str(tmp_path / f"{n}.jsonl")] for n in names]
    out = dict(zip(names, (r.stdout for r in torchrun_many(2, runs))))
    loss = {n: _losses(tmp_path / f"{n}.jsonl") for n in names}
    clean = loss["clean"]
    assert sorted(clean) == list(range(1, 10)) and all(map(math.isfinite, clean.values()))

    # Transient: named (rank 1, the first parameter in model order), re-run, and the re-run's update
    # is the step's: the curve is the clean one, bit for bit, and nothing is counted as skipped.
    t = out["transient"]
    assert "iteration 4 rejected (gradient norm nan) in the first run: rank 1 (host " in t, t
    assert "a NaN/Inf gradient first in embedding.word_embeddings.weight" in t
    assert "rank 0 (host" not in t  # rank 0's own gradients were finite before the reduction
    assert "the re-run did not reproduce the fault (a transient error" in t
    assert loss["transient"] == clean
    assert all(c == (0, 0) for c in _counters(t).values())
    tracked = (tmp_path / "rejected.txt").read_text().splitlines()
    assert [re.search(r"iteration=(\d+) status=(\w+)", ln).groups() for ln in tracked] == [
        ("4", "initial_run"),
        ("4", "first_rerun_not_reproducible"),
    ]

    # Reproduced: the batch is skipped (1 skipped, 1 nan iteration on its line), and every later
    # loss equals that of a run told to skip iteration 4 (--iterations-to-skip 4).
    p = out["persistent"]
    assert "iteration 4: the re-run reproduced it; the batch is skipped" in p, p
    assert _counters(p)[4] == (1, 1) and _counters(out["skip4"])[4] == (1, 0)
    tracked = (tmp_path / "kept.txt").read_text().splitlines()
    assert [re.search(r"iteration=(\d+) status=(\w+)", ln).groups() for ln in tracked] == [
        ("4", "initial_run"),
        ("4", "first_rerun_reproducible"),
    ]
    assert all(c == (0, 0) for it, c in _counters(p).items() if it != 4)
    after = {it: v for it, v in loss["persistent"].items() if it > 4}
    assert sorted(after) == [5, 6, 7, 8, 9] and after == {it: loss["skip4"][it] for it in after}
    assert after != {it: clean[it] for it in after}  # the skip changed the curve

    # A spike on one rank's loss (x1000) at iteration 7: caught, reproduced, skipped like the batch.
    s = out["spike"]
    assert "iteration 7 rejected (loss spike" in s and "rank 1 (host" in s and "a loss spike (" in s, s
    assert _counters(s)[7] == (1, 0)
    assert {it: loss["spike"][it] for it in (8, 9)} == {it: loss["skip7"][it] for it in (8, 9)}
    assert {it: loss["spike"][it] for it in range(1, 7)} == {it: clean[it] for it in range(1, 7)}

    # With pipeline stages the stages agree through the norms' all-reduce: the first stage's NaN is
    # named on rank 0, and the skip equals --iterations-to-skip 4 on the same layout.
    pp = out["pp-persistent"]
    assert "iteration 4 rejected (gradient norm nan) in the first run: rank 0 (host " in pp, pp
    assert "rank 1 (host" not in pp and "iteration 4: the re-run reproduced it" in pp
    assert _counters(pp)[4] == (1, 1)
    assert {it: v for it, v in loss["pp-persistent"].items() if it > 4} == {
        it: v for it, v in loss["pp-skip4"].items() if it > 4
    }

    # report_stats: every step twice, the second kept: the clean curve, and the comparison reported.
    assert loss["stats"] == clean
    assert "rerun stats (--rerun-mode report_stats): loss: " in out["stats"]


def test_disabled_mode_and_a_second_bad_step_stop_with_the_model_untouched(tmp_path, capsys):
    ck = tmp_path / "ck"
    common = BASE + ["--train-iters", "6", "--error-injection-ranks", "0"]
    assert (
        run(
            common
            + f"--error-injection-iterations 4 --rerun-mode disabled --save {ck} --save-interval 1".split()
        )
        == 3
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "non-finite gradient norm (nan) at iteration 4" in err[0]
        and "computed from the weights of iteration 3" in err[0]
    )
    assert "a NaN/Inf gradient first in embedding.word_embeddings.weight" in err[0], err[0]
    # Persistent at 4 and 5: 4 is skipped, 5 right after it stops the run.
    capsys.readouterr()
    assert (
        run(common + "--error-injection-iterations 4 5 --error-injection-type persistent_error".split()) == 3
    )
    captured = capsys.readouterr()
    assert "iteration 4: the re-run reproduced it; the batch is skipped" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "non-finite gradient norm (nan) at iteration 5" in err[0], err
