#!/usr/bin/env python3
"""Loss curves of several parallel layouts against one GPU (or one process), bf16 on NCCL.

    python bench/layout_match.py --layouts "1:;2:--tensor-model-parallel-size 2 --sequence-parallel;2:" \
        --iters 50

Each layout is ``NPROC:EXTRA FLAGS``; the first is the reference. Prints, per layout, the largest
relative difference of the per-step loss against the reference over all steps, and the final losses.
A correct layout differs only by bf16 rounding (reduction order), typically well under 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16 "
    "--vocab-size 32000 --mock-data --tokenizer-type NullTokenizer --lr 3e-4 --lr-warmup-iters 5 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --num-workers 1 --bf16"
)


def run(nproc: int, extra: str, iters: int, metrics: str) -> dict[int, float]:
    return run_command(nproc, f"{MODEL} --train-iters {iters} {extra}", metrics)


def run_command(nproc: int, flags: str, metrics: str) -> dict[int, float]:
    """pretrain_gpt.py with ``flags`` under torchrun; returns iteration -> training loss."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *shlex.split(flags),
        "--metrics-file",
        metrics,
    ]
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        print(res.stdout[-3000:], res.stderr[-5000:])
        raise SystemExit(f"pretrain_gpt.py {flags} failed")
    with open(metrics) as f:
        return {r["iteration"]: r["lm loss"] for r in map(json.loads, f) if "lm loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--layouts", default="1:;2:--tensor-model-parallel-size 2 --sequence-parallel;2:--overlap-grad-reduce"
    )
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="layout_match_")
    results = []
    ref = None
    for i, spec in enumerate(args.layouts.split(";")):
        nproc, extra = spec.split(":", 1)
        curve = run(int(nproc), extra, args.iters, os.path.join(work, f"{i}.jsonl"))
        if ref is None:
            ref = curve
        worst = max(abs(curve[k] - ref[k]) / abs(ref[k]) for k in ref)
        results.append(
            dict(nproc=int(nproc), extra=extra, max_rel_diff=worst, first=curve[1], final=curve[args.iters])
        )
        print(
            f"nproc={nproc} {extra or '(data parallel / reference)'}: max rel diff {worst:.2e}, "
            f"loss {curve[1]:.4f} -> {curve[args.iters]:.4f}",
            flush=True,
        )
    out = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "layout_match.jsonl"), "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
