"""tests/functional/multi_run.py: runs that share one torchrun launch train as separate launches do.

A run that follows another in the same processes (a different layout: pipeline stages with virtual
chunks, whose groups, RNG trackers and runtime state are torn down in between) gives the metrics of
the same flags launched alone, bit for bit: losses, grad norms, validation losses, learning rates.
"""

import json

import pytest
from launch import torchrun, torchrun_many

BASE = (
    "--hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --mock-data --vocab-size 256 "
    "--num-workers 0 --log-interval 1 --eval-iters 1 --eval-interval 2 --train-iters 4"
).split()
FIRST = (
    BASE + "--num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1".split()
)
# tp2 + sequence parallel, dropout at its default 0.1: the tensor-parallel RNG tracker's streams are in
# the losses
SECOND = BASE + "--num-layers 2 --tensor-model-parallel-size 2 --sequence-parallel".split()
# Measurements of the process, not results of the run: timings, and memory ("mem-*": a process that
# ran a run before has a larger peak RSS).
TIMINGS = ("time", "iteration-time", "throughput", "tokens-per-sec-per-gpu")


def records(path: str) -> list[dict]:
    """The metrics file's records without their timings."""
    with open(path) as f:
        return [
            {k: v for k, v in rec.items() if k not in TIMINGS and not k.startswith("mem-")}
            for rec in map(json.loads, f)
        ]


@pytest.mark.slow
def test_a_run_after_another_in_one_launch_matches_a_launch_of_its_own(tmp_path):
    first, second = torchrun_many(
        2,
        [
            FIRST + ["--metrics-file", f"{tmp_path}/first.jsonl"],
            SECOND + ["--metrics-file", f"{tmp_path}/shared.jsonl"],
        ],
    )
    assert "pp rank 1 chunk 1" in first.stdout and "pp rank" not in second.stdout  # each run's own log
    alone = torchrun(2, SECOND + ["--metrics-file", f"{tmp_path}/alone.jsonl"])
    assert "multi_run.py" not in alone.stdout
    shared, own = records(f"{tmp_path}/shared.jsonl"), records(f"{tmp_path}/alone.jsonl")
    assert [r["iteration"] for r in own if "lm loss" in r] == [1, 2, 3, 4]
    assert any("lm loss validation" in r for r in own)
    assert shared == own
