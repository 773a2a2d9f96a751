#!/usr/bin/env python3
"""Throughput of pretrain_gpt.py on the baseline's model shapes, and optionally the baseline itself.

    python bench/bench_gpt.py --configs gpt-1.3b,llama-3b [--iters 30] [--baseline DIR] [--nproc N]
                              [--extra="--tensor-model-parallel-size 2 --sequence-parallel"] [--breakdown]

Each configuration runs the real training path (``pretrain_gpt.py`` with mock data: loop, logging,
data loader) under torchrun, logging every step to a metrics file. The table reports medians over
the steps after ``--warmup``: step time, tokens/s per GPU, TFLOP/s per GPU and MFU (Megatron's FLOPs
formula, causal attention halved) and peak allocated memory. With ``--baseline DIR`` (a copy of
shared/baselines) the plain PyTorch script runs too, in the same job, and its tokens/s are printed
beside ours. ``--breakdown`` profiles the last two steps on rank 0 (left out of the medians) and adds
where the step went: GPU time by kernel category, idle time and exposed communication. Results are
appended as JSON lines to ``$OUT/bench_gpt.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIXTRAL_PROXY = (
    "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention "
    "--num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--rotary-base 1000000 --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 2 --vocab-size 32000"
)
MIXTRAL_PROXY_MOE = (
    "--ffn-hidden-size 5632 --num-experts 8 --moe-ffn-hidden-size 5632 --moe-router-topk 2 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
)

CONFIGS = {
    "gpt-1.3b": (
        "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
        "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 8 --vocab-size 50304 "
        "--make-vocab-size-divisible-by 128"
    ),
    "llama-3b": (
        "--num-layers 26 --hidden-size 3072 --num-attention-heads 24 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 8192 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear --seq-length 4096 "
        "--max-position-embeddings 4096 --micro-batch-size 2 --vocab-size 128256"
    ),
    "llama3-8b": (
        "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear "
        "--untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 1 --vocab-size 128256"
    ),
    # Mixtral's shape scaled to one H200 (hidden 2048, 16 layers, 8 experts top-2 of FFN 5632, GQA 4:1
    # with head size 128, rope base 1e6, untied, vocabulary 32000, aux loss 1e-2 as Megatron-LM's
    # Mixtral example): 4.73B parameters, 1.41B active per token. "-loop" runs the experts in a
    # Python loop; "-dense" is the dense model of the same active parameters (FFN 2 x 5632).
    "mixtral-proxy": MIXTRAL_PROXY + " " + MIXTRAL_PROXY_MOE + " --moe-grouped-gemm",
    "mixtral-proxy-loop": MIXTRAL_PROXY + " " + MIXTRAL_PROXY_MOE,
    "mixtral-proxy-dense": MIXTRAL_PROXY + " --ffn-hidden-size 11264",
    "tiny-moe": (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --vocab-size 512 --swiglu --disable-bias-linear "
        "--num-experts 4 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm"
    ),
    "tiny": (
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
        "--max-position-embeddings 512 --micro-batch-size 4 --vocab-size 32000"
    ),
}
COMMON = (
    "--bf16 --mock-data --tokenizer-type NullTokenizer --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine "
    "--weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 "
    "--log-interval 1 --eval-iters 0 --num-workers 2 --seed 1234"
)


class GpuMonitor:
    """Samples GPU 0's SM clock and power with nvidia-smi while a run lasts. The medians over the busy
    samples (power at least half the highest seen: training, not start-up) tell whether two runs of
    the same kernels ran at the same clock (H200s are power-limited). Does nothing without nvidia-smi."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.path = ""

    def __enter__(self) -> GpuMonitor:
        if shutil.which("nvidia-smi") is None:
            return self
        fd, self.path = tempfile.mkstemp(suffix=".csv")
        with os.fdopen(fd, "w") as out:
            self.proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=index,clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "200",
                ],
                stdout=out,
                stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def summary(self) -> dict:
        samples = []
        if self.path:
            for line in open(self.path):
                parts = [x.strip() for x in line.split(",")]
                try:
                    if len(parts) == 3 and parts[0] == "0":
                        samples.append((float(parts[1]), float(parts[2])))
                except ValueError:
                    continue
        if not samples:
            return {}
        top = max(w for _, w in samples)
        busy = [(c, w) for c, w in samples if w >= 0.5 * top]
        return {
            "sm_clock_mhz_median": statistics.median(c for c, _ in busy),
            "power_w_median": statistics.median(w for _, w in busy),
            "gpu_samples": len(busy),
        }


def random_token_data(name: str, iters: int, workdir: str) -> str:
    """Prefix of an indexed dataset of uniformly random tokens over the configuration's vocabulary,
    enough for ``iters`` steps: the baseline's kind of synthetic data (mock data instead counts up,
    ``1, 2, 3, ...``, which the model learns within a few steps)."""
    sys.path.insert(0, ROOT)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    flags = CONFIGS[name].split()
    value = {
        k: int(flags[flags.index(k) + 1]) for k in ("--vocab-size", "--seq-length", "--micro-batch-size")
    }
    seq = value["--seq-length"] + 1
    n_seq = (iters + 2) * value["--micro-batch-size"] * 2
    prefix = os.path.join(workdir, f"random_{name}")
    tokens = np.random.default_rng(1).integers(0, value["--vocab-size"], size=n_seq * seq, dtype=np.int32)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_documents(tokens, np.full(n_seq, seq, dtype=np.int64))
    builder.finalize(prefix + ".idx")
    return prefix


def run_ours(
    name: str, iters: int, nproc: int, extra: str, workdir: str, tag: str = "", random_tokens: bool = False
) -> tuple[list[dict], dict]:
    """(the per-step metric records, GPU clock/power summary) of one pretrain_gpt.py run."""
    metrics = os.path.join(workdir, f"{name}{tag}.jsonl")  # a file per run: runs of one config differ by tag
    common = COMMON.split()
    if random_tokens:
        prefix = random_token_data(name, iters * nproc, workdir)
        common[common.index("--mock-data")] = f"--data-path={prefix}"
        common.append("--split=100,0,0")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *CONFIGS[name].split(),
        *common,
        "--train-iters",
        str(iters),
        "--metrics-file",
        metrics,
        *extra.split(),
    ]
    print("$ " + " ".join(cmd), flush=True)
    log = os.path.join(workdir, f"{name}.log")
    with open(log, "w") as f, GpuMonitor() as monitor:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        print(open(log).read()[-5000:], flush=True)
        raise SystemExit(f"{name}: pretrain_gpt.py failed with exit code {rc}")
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(log, os.path.join(out_dir, f"{name}{tag}.log"))
    lines = open(log).read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(" > kernels")), None)
    kernels = [] if start is None else lines[start : start + 8]
    print("\n".join(kernels), flush=True)
    with open(metrics) as f:
        return [json.loads(line) for line in f if '"lm loss"' in line], monitor.summary()


def summarise(name: str, records: list[dict], warmup: int, nproc: int, extra: str) -> dict:
    steady = records[warmup:]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    return {
        "config": name,
        "nproc": nproc,
        "extra": extra,
        "steps": len(steady),
        "step_ms": med("iteration-time") * 1000.0,
        "tokens_per_s_per_gpu": med("tokens-per-sec-per-gpu"),
        "tflops_per_gpu": med("throughput"),
        "mfu": med("mfu") if steady[0].get("mfu") is not None else None,
        "peak_gib": max(r.get("mem-max-allocated-bytes", 0) for r in records) / 2**30,
        "final_loss": records[-1]["lm loss"],
    }


def run_baseline(baseline_dir: str, names: list[str], workdir: str) -> dict:
    known = [n for n in names if n != "tiny"]
    if not known:
        return {}
    env = {**os.environ, "OUT": workdir}
    baseline_dir = os.path.abspath(baseline_dir)
    cmd = [
        sys.executable,
        os.path.join(baseline_dir, "bench_plain.py"),
        "--parts",
        "compile",
        "--configs",
        ",".join(known),
    ]
    print("$ " + " ".join(cmd), flush=True)
    with GpuMonitor() as monitor:
        subprocess.run(cmd, cwd=baseline_dir, env=env, check=True)
    gpu = monitor.summary()
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    shutil.copy(os.path.join(workdir, "results.jsonl"), os.path.join(out_dir, "baseline_results.jsonl"))
    out = {}
    with open(os.path.join(workdir, "results.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("config") in known and "tokens_per_s" in rec:
                out[rec["config"]] = {**rec, "gpu_monitor_both_configs": gpu}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="gpt-1.3b,llama-3b")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--extra", default="", help="extra pretrain_gpt.py flags for every configuration")
    ap.add_argument("--tag", default="", help="suffix of the per-config logs copied to $OUT")
    ap.add_argument(
        "--baseline", default=None, help="folder holding bench_plain.py (a copy of shared/baselines)"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="profile the last two steps on rank 0 (left out of the medians) and add the step-time "
        "breakdown: GPU time by kernel category, idle time and exposed communication",
    )
    ap.add_argument(
        "--random-tokens",
        action="store_true",
        help="train on uniformly random tokens (the baseline's synthetic data) instead of mock data",
    )
    args = ap.parse_args()
    names = args.configs.split(",")
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_gpt_")
    rows = []
    for n in names:
        extra, prof_dir = args.extra, os.path.join(workdir, f"profile_{n}")
        if args.breakdown:
            extra += (
                f" --profile --use-pytorch-profiler --profile-step-start {args.iters - 1} "
                f"--profile-step-end {args.iters + 1} --profile-dir {prof_dir}"
            )
        records, gpu = run_ours(n, args.iters, args.nproc, extra, workdir, args.tag, args.random_tokens)
        row = summarise(n, records[:-2] if args.breakdown else records, args.warmup, args.nproc, args.extra)
        row.update(gpu)
        row["tag"] = args.tag
        if args.breakdown:
            with open(os.path.join(prof_dir, "breakdown_rank0.json")) as f:
                row["breakdown"] = json.load(f)
            shutil.copy(
                os.path.join(prof_dir, "kernels_rank0.txt"),
                os.path.join(out_dir, f"kernels_{n}{args.tag}.txt"),
            )
            with (
                open(os.path.join(prof_dir, "trace_rank0.json"), "rb") as src,
                gzip.open(os.path.join(out_dir, f"trace_{n}{args.tag}.json.gz"), "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        rows.append(row)
    for r in rows:
        print("ours: " + json.dumps(r), flush=True)
    base = run_baseline(args.baseline, names, workdir) if args.baseline else {}
    print(
        f"\n{'config':<10} {'step ms':>9} {'tok/s/GPU':>10} {'TFLOP/s/GPU':>12} {'MFU':>6} {'peak GiB':>9} "
        f"{'baseline tok/s':>15} {'ratio':>6} {'SM MHz ours/base':>17}"
    )
    with open(os.path.join(out_dir, "bench_gpt.jsonl"), "a") as f:
        for r in rows:
            b = base.get(r["config"], {}).get("tokens_per_s")
            r["baseline_compile_tokens_per_s"] = b
            r["baseline_gpu"] = base.get(r["config"], {}).get("gpu_monitor_both_configs")
            f.write(json.dumps(r) + "\n")
            mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "   n/a"
            ratio = f"{r['tokens_per_s_per_gpu'] / b:6.2f}" if b else "     -"
            clocks = f"{r.get('sm_clock_mhz_median', '-')}/{(r['baseline_gpu'] or {}).get('sm_clock_mhz_median', '-')}"
            print(
                f"{r['config']:<10} {r['step_ms']:9.1f} {r['tokens_per_s_per_gpu']:10.0f} "
                f"{r['tflops_per_gpu']:12.1f} {mfu} {r['peak_gib']:9.1f} {b or '-':>15} {ratio} {clocks:>17}"
            )


if __name__ == "__main__":
    main()
