#!/usr/bin/env python3
"""The memory estimate against the measured peak, on the GPU (issue 26: within 10%).

    python bench/bench_memory.py [--configs gpt-1.3b,llama-3b,llama-3b-recompute,llama-3b-distopt]
                                 [--iters 5]

Each configuration trains a few steps through ``pretrain_gpt.py`` (bench/bench_gpt.py's shapes and
settings: bf16, mock data) under torchrun and records ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` (the metrics file's ``mem-max-*-bytes``, the largest over the run). Beside
them: the estimate the run printed at start-up (its own execution plan: the kernels that passed
their self-check, the SDPA backend, compiled layers) and the dry run's (``--dry-run --world-size``
on the same flags: the CUDA path assumed), as the largest peak over pipeline stages, and their
ratios to the measured allocated peak. Results: a table on stdout and ``$OUT/bench_memory.json``
(or ./bench_out/).

Distributed optimizer: on one GPU the data-parallel size is 1 and ``--use-distributed-optimizer``
shards nothing (the plain optimizer's memory; ``llama-3b-distopt`` shows that pair). With two GPUs
``llama-3b-distopt-dp2`` runs dp2, where the optimizer state per GPU halves; it is skipped (and
says so) on a machine with fewer GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_gpt import COMMON, CONFIGS, run_ours  # noqa: E402

RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
# name -> (bench_gpt shape, extra flags, processes)
RUNS = {
    "gpt-1.3b": ("gpt-1.3b", "", 1),
    "llama-3b": ("llama-3b", "", 1),
    "llama-3b-recompute": ("llama-3b", RECOMPUTE, 1),
    "llama-3b-distopt": ("llama-3b", "--use-distributed-optimizer", 1),
    "llama-3b-distopt-dp2": ("llama-3b", "--use-distributed-optimizer", 2),
    "llama-3b-mb4-recompute": ("llama-3b", "--micro-batch-size 4 " + RECOMPUTE, 1),
    "llama-3b-fp8": ("llama-3b", "--fp8-format hybrid --fp8-recipe tensorwise", 1),
    "llama-3b-fsdp2": ("llama-3b", "--use-torch-fsdp2 --init-model-with-meta-device", 1),
    "llama-3b-offload": ("llama-3b", "--optimizer-cpu-offload --optimizer-offload-fraction 1.0", 1),
    "tiny": ("tiny", "", 1),  # a smoke test of this script (runs on a CPU; nothing measured there)
}
GIB = float(2**30)


def startup_estimate(log_text: str) -> float | None:
    """The largest stage peak (bytes) of the table the run printed at start-up, or None."""
    lines = log_text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "> memory estimate" in ln), None)
    if start is None:
        return None
    unit = GIB if "(GiB)" in lines[start + 1] else float(2**20)
    peaks = []
    for ln in lines[start + 3 :]:
        cols = ln.split()
        if len(cols) != 13 or not cols[0].isdigit():
            break
        peaks.append(float(cols[-1]) * unit)
    return max(peaks) if peaks else None


def dry_run_estimate(shape: str, extra: str, nproc: int, iters: int) -> dict:
    """The dry run's estimate of the same flags: the busiest stage's terms, in GiB."""
    from megatron.training.arguments import parse_run_config
    from megatron.training.cli import _Layout
    from megatron.training.gpt import GPTProviders
    from megatron.training.memory_estimate import estimate

    argv = CONFIGS[shape].split() + COMMON.split() + ["--train-iters", str(iters)] + extra.split()
    cfg = parse_run_config(argv + ["--dry-run", "--world-size", str(nproc)])
    _, padded = GPTProviders.tokenizer(cfg, _Layout(cfg.model.tensor_model_parallel_size))
    stage = max(estimate(cfg, padded, nproc), key=lambda s: s.peak)
    terms = ("weights", "gradients", "optimizer", "activations_at_peak", "logits", "peak")
    return {k: getattr(stage, k) / GIB for k in terms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default="gpt-1.3b,llama-3b,llama-3b-recompute,llama-3b-distopt,llama-3b-distopt-dp2"
    )
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.configs.split(","):
            shape, extra, nproc = RUNS[name]
            if nproc > max(gpus, 1):  # (one process runs on a CPU too: the tiny smoke test)
                print(f"{name}: skipped (needs {nproc} GPUs, this machine has {gpus})", flush=True)
                results.append({"config": name, "skipped": f"needs {nproc} GPUs"})
                continue
            dry = dry_run_estimate(shape, extra, nproc, args.iters)
            try:
                records, _ = run_ours(shape, args.iters, nproc, extra, workdir, tag=f"-{name}")
            except SystemExit as exc:  # out of memory, say: keep the other configurations
                print(f"{name}: {exc}", flush=True)
                results.append({"config": name, "failed": str(exc), "dry_run_estimate_gib": dry})
                continue
            log = open(os.path.join(workdir, f"{shape}.log")).read()
            allocated = max(r.get("mem-max-allocated-bytes", 0) for r in records) / GIB
            reserved = max(r.get("mem-max-reserved-bytes", 0) for r in records) / GIB
            start = startup_estimate(log)
            row = {
                "config": name,
                "flags": " ".join([CONFIGS[shape], extra]).strip(),
                "nproc": nproc,
                "steps": len(records),
                "measured_max_allocated_gib": allocated,
                "measured_max_reserved_gib": reserved,
                "startup_estimate_gib": None if start is None else start / GIB,
                "dry_run_estimate_gib": dry,
                "startup_ratio": None if start is None or not allocated else start / GIB / allocated,
                "dry_run_ratio": dry["peak"] / allocated if allocated else None,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n{'config':<24} {'allocated':>10} {'reserved':>10} {'start-up est':>13} {'dry-run est':>12} ratios"
    )
    for r in results:
        if "measured_max_allocated_gib" not in r:
            print(f"{r['config']:<24} {r.get('skipped') or r.get('failed')}")
            continue
        start = r["startup_estimate_gib"]
        print(
            f"{r['config']:<24} {r['measured_max_allocated_gib']:>10.2f} {r['measured_max_reserved_gib']:>10.2f} "
            f"{(start or float('nan')):>13.2f} {r['dry_run_estimate_gib']['peak']:>12.2f} "
            f"{(r['startup_ratio'] or float('nan')):.3f} / {r['dry_run_ratio']:.3f}"
        )
    path = os.path.join(out_dir, "bench_memory.json")
    with open(path, "w") as f:
        json.dump(
            {"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else None, "results": results},
            f,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
