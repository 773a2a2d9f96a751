"""``pretrain_gpt.py --dry-run --world-size 1024`` of a Llama-3-70B configuration (tp8 pp8) prints
the per-stage memory table on a CPU in seconds (issue 26)."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_70B = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --seq-length 8192 --max-position-embeddings 8192 "
    "--vocab-size 128256 --micro-batch-size 1 --global-batch-size 1024 --bf16 --lr 1e-4 --train-iters 10 "
    "--mock-data --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel "
    "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1"
)


@pytest.mark.slow
def test_dry_run_of_llama_70b_on_1024_gpus_prints_the_per_stage_table():
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *LLAMA_70B.split()]
    cmd += ["--dry-run", "--world-size", "1024"]
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stderr[-3000:]
    assert elapsed < 60, f"the dry run took {elapsed:.1f} s"
    out = res.stdout.splitlines()
    assert any("parameters: 70,5" in ln for ln in out)
    header = next(i for i, ln in enumerate(out) if ln.split()[:3] == ["stage", "layers", "params"])
    rows = [ln.split() for ln in out[header + 1 : header + 9]]
    assert [int(r[0]) for r in rows] == list(range(8)) and all(r[1] == "10" for r in rows)
    # 1F1B: pipeline rank r holds pp - r = 8 - r micro-batches (64 per step here) at its peak.
    assert [float(r[8]) for r in rows] == [8.0 - r for r in range(8)]
    peaks = [float(r[-1]) for r in rows]
    assert all(5 < p < 80 for p in peaks)  # GiB per GPU
    for size in (80, 141):
        line = next(ln for ln in out if f"largest micro-batch that fits {size} GiB" in ln)
        assert int(line.split(": ")[1].split()[0]) >= 1
