#!/usr/bin/env python3
"""Tokens/s and peak memory with and without optimizer CPU offload, on one GPU, in one invocation.

    python bench/bench_offload.py [--runs llama3-8b:0.75,llama-3b:1.0,llama-3b:0] [--iters 8]
                                  [--warmup 3] [--global-batch-size 8] [--no-overlap] [--extra="..."]

Each run is ``name:fraction``: a configuration of bench/bench_gpt.py (the same shapes and flags,
bf16, mock data, clipping on) trained by ``pretrain_gpt.py`` on one GPU with
``--optimizer-cpu-offload --optimizer-offload-fraction <fraction>`` (fraction 0: no offload). With
``--overlap`` (the default) the copies run on side streams (``--overlap-cpu-optimizer-d2h-h2d``).

Memory of Llama-3-8B (8.0e9 params, bf16 weights, fp32 gradients, AdamW): without offload 2 + 4 + 12 =
18 bytes per param (144 GB) does not fit an H200; offloading a fraction f keeps 2 + 4 + 12 (1 - f)
bytes per param on the GPU (plus activations) and puts 12 f bytes per param (96 GB at f = 1) in host
memory, with two chunks of gradients and of bf16 params in pinned staging slots. On a host of
128 GB, f = 0.75 (72 GB) leaves room for the rest of the process; ``--extra=--grad-reduce-in-bf16``
halves the gradients on the GPU and in the slots.

Reports, per run, the median step time and tokens/s after ``--warmup`` steps,
``torch.cuda.max_memory_allocated`` (GiB) and the peak host memory in use (GiB, MemTotal - MemAvailable
sampled every 0.5 s); a run that fails (out of memory) is recorded with its error. Rows are written
to ``$OUT/bench_offload.json`` (or ./bench_out/) and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpt  # noqa: E402


class HostMemory:
    """Peak of MemTotal - MemAvailable (/proc/meminfo) while the block runs, in bytes."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"] - info["MemAvailable"]

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(0.5)

    def __enter__(self) -> HostMemory:
        self.baseline = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def offload_flags(fraction: float, overlap: bool) -> str:
    if fraction <= 0.0:
        return ""
    flags = f"--optimizer-cpu-offload --optimizer-offload-fraction {fraction}"
    return flags + (" --overlap-cpu-optimizer-d2h-h2d" if overlap else "")


def run_one(name: str, fraction: float, args: argparse.Namespace, workdir: str) -> dict:
    extra = (
        f"{offload_flags(fraction, args.overlap)} --global-batch-size {args.global_batch_size} {args.extra}"
    )
    tag = f"_offload{fraction:g}" if fraction > 0 else "_no_offload"
    row: dict = {"config": name, "offload_fraction": fraction, "extra": extra.strip()}
    with HostMemory() as host:
        try:
            records, gpu = bench_gpt.run_ours(name, args.iters, 1, extra, workdir, tag)
        except SystemExit as e:  # pretrain_gpt.py failed (its log tail is printed above)
            row["error"] = str(e)
            records, gpu = [], {}
    row["host_peak_gib"] = host.peak / 2**30
    row["host_before_gib"] = host.baseline / 2**30
    if records:
        row.update(bench_gpt.summarise(name, records, args.warmup, 1, extra.strip()))
        row.update(gpu)
        row["max_memory_allocated_gib"] = row.pop("peak_gib")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs",
        default="llama3-8b:0.75,llama-3b:1.0,llama-3b:0",
        help="comma-separated name:fraction (names of bench_gpt.CONFIGS; fraction 0: no offload)",
    )
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch-size", type=int, default=8, help="micro-batches of gradient accumulation")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--extra", default="", help="extra pretrain_gpt.py flags for every run")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or os.path.join(bench_gpt.ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_offload_")
    rows = []
    for spec in args.runs.split(","):
        name, _, fraction = spec.partition(":")
        rows.append(run_one(name, float(fraction or 0.0), args, workdir))
        print("run: " + json.dumps(rows[-1]), flush=True)
        with open(os.path.join(out_dir, "bench_offload.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(
        f"\n{'config':<10} {'offload':>7} {'step ms':>9} {'tok/s/GPU':>10} {'GPU max alloc GiB':>18} "
        f"{'host peak GiB':>14}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<10} {r['offload_fraction']:7g}   failed: {r['error']}")
            continue
        print(
            f"{r['config']:<10} {r['offload_fraction']:7g} {r['step_ms']:9.1f} {r['tokens_per_s_per_gpu']:10.0f} "
            f"{r['max_memory_allocated_gib']:18.1f} {r['host_peak_gib']:14.1f}"
        )


if __name__ == "__main__":
    main()
