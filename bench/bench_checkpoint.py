#!/usr/bin/env python3
"""Checkpoint save and load time and size, synchronous against --async-save (issue 27).

    python bench/bench_checkpoint.py [--configs gpt-1.3b,llama-3b] [--dir /tmp] [--out PATH]

One process (one GPU, or the CPU with ``--configs tiny``) builds pretrain_gpt.py's Trainer for each of
bench/bench_gpt.py's shapes (its flags: bf16, mock data) and runs its real loop three times:

1. synchronous: ``--save-interval`` W, one save after W steps; its time is the training stall;
2. load: the Trainer's ``--load`` of that checkpoint, with the page cache of its files dropped first
   (``posix_fadvise(DONTNEED)``: a cold read, as a restarted job does), then again warm;
3. asynchronous: ``--async-save``, two saves S steps apart and S more steps, S chosen so that S steps
   outlast the synchronous save (training goes on while the files are written). Per save: the stall
   (the time the step loop is blocked in ``save()``; the first save also allocates and pins the host
   buffers, the second reuses them) and the time until the checkpoint is complete (tracked), as the
   loop sees it between steps; and the median step time while a write is in flight against without.

Each checkpoint is deleted as soon as it is measured (a llama-3b checkpoint with its optimizer state is
about 45 GB), under ``--dir`` (default: a temporary directory in /tmp; local disk). Results: a table on
stdout and JSON at ``--out`` (default ``$OUT/bench_checkpoint.json``, or ./bench_out/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_gpt import COMMON, CONFIGS  # noqa: E402

GB = 1e9


def disk_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def drop_page_cache(path: str) -> None:
    """Evict the (written, clean) pages of the files under ``path`` from the page cache."""
    for d, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclasses.dataclass
class SaveRecord:
    iteration: int
    start: float  # time.monotonic() when save() was called
    stall_s: float  # time inside save(): the loop is blocked
    complete_s: float | None = None  # from the start of save() to the checkpoint being tracked
    complete_at: int | None = None  # the iteration the loop had reached then
    bytes: int = 0


class Recorder:
    """Times a Trainer's saves (``save`` and the completion hook ``_saved``) and deletes each checkpoint
    once measured, except ``keep`` (the one the load phase reads)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.saves, self.keep = trainer, [], False
        save, saved = trainer.save, trainer._saved

        def timed_save() -> None:
            record = SaveRecord(trainer.state.iteration, time.monotonic(), 0.0)
            self.saves.append(record)  # before: a synchronous save completes inside save()
            save()
            record.stall_s = time.monotonic() - record.start

        def timed_saved(state, previous) -> None:
            saved(state, previous)
            rec = next(r for r in self.saves if r.iteration == state.iteration)
            rec.complete_s = time.monotonic() - rec.start
            rec.complete_at = trainer.state.iteration
            path = os.path.join(trainer.cfg.checkpoint.save, f"iter_{state.iteration:07d}")
            rec.bytes = disk_bytes(path)
            if not self.keep:
                shutil.rmtree(path)

        trainer.save, trainer._saved = timed_save, timed_saved


def build_trainer(name: str, save_dir: str, metrics: str):
    from megatron.training.arguments import parse_run_config
    from megatron.training.gpt import GPTProviders
    from megatron.training.training import Trainer

    argv = CONFIGS[name].split() + COMMON.split()
    argv = [a for a in argv if a != "--bf16"] if name == "tiny" else argv  # the CPU trains in fp32
    argv += ["--train-iters", "1000000", "--save", save_dir, "--metrics-file", metrics, "--num-workers", "0"]
    cfg = parse_run_config(argv)
    return Trainer(cfg, GPTProviders(cfg))


def run_saves(trainer, saves: int, save_interval: int, async_save: bool) -> None:
    """The Trainer's loop on to the ``saves``-th next multiple of ``save_interval``, saving at each; the
    last save is at the last step (``train`` waits for it as it ends)."""
    ck = trainer.cfg.checkpoint
    ck.save_interval, ck.async_save = save_interval, async_save
    trainer.train_iters = (trainer.state.iteration // save_interval + saves) * save_interval
    trainer.train()


def step_times(metrics: str) -> dict[int, float]:
    with open(metrics) as f:
        return {r["iteration"]: r["iteration-time"] for r in map(json.loads, f) if "iteration-time" in r}


def bench_config(name: str, root: str, warmup: int, async_interval: int | None = None) -> dict:
    import torch

    save_dir, metrics = os.path.join(root, name), os.path.join(root, f"{name}.jsonl")
    t0 = time.monotonic()
    trainer = build_trainer(name, save_dir, metrics)
    rec = Recorder(trainer)
    built_s = time.monotonic() - t0
    # 1. synchronous: one save, kept for the load
    rec.keep = True
    run_saves(trainer, 1, warmup, async_save=False)
    sync = rec.saves[-1]
    ckpt = os.path.join(save_dir, f"iter_{sync.iteration:07d}")
    # 2. load, cold then warm
    loads = {}
    trainer.cfg.checkpoint.load = save_dir
    for kind in ("cold", "warm"):
        if kind == "cold":
            drop_page_cache(ckpt)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.monotonic()
        trainer._load()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loads[kind] = time.monotonic() - start
    trainer.cfg.checkpoint.load = None
    shutil.rmtree(ckpt)
    rec.keep = False
    # 3. asynchronous: two saves S steps apart, S steps outlasting the synchronous save
    times = step_times(metrics)
    step_s = statistics.median(times[i] for i in range(2, sync.iteration)) if sync.iteration > 2 else 0.1
    interval = async_interval or max(4, min(400, math.ceil(1.3 * sync.stall_s / max(step_s, 1e-3)) + 2))
    first_async, start = len(rec.saves), trainer.state.iteration
    run_saves(trainer, 2, interval, async_save=True)
    times = step_times(metrics)
    asyncs = rec.saves[first_async:]
    # the step after a save includes its stall; the steps up to its completion ran beside the write
    after = {r.iteration + 1 for r in asyncs}
    in_flight = {
        it for r in asyncs if r.complete_at is not None for it in range(r.iteration + 2, r.complete_at + 1)
    }
    quiet = [t for it, t in times.items() if it > start + 1 and it not in in_flight | after]
    busy = [times[it] for it in sorted(in_flight) if it in times]
    trainer.writer.close()
    del trainer, rec
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "config": name,
        "flags": CONFIGS[name],
        "build_s": built_s,
        "checkpoint_gb": sync.bytes / GB,
        "sync_save_s": sync.stall_s,
        "load_cold_s": loads["cold"],
        "load_warm_s": loads["warm"],
        "async_interval_steps": interval,
        "async_saves": [
            {
                "iteration": r.iteration,
                "stall_s": r.stall_s,
                "complete_s": r.complete_s,
                "completed_at_iteration": r.complete_at,
                "gb": r.bytes / GB,
            }
            for r in asyncs
        ],
        "step_s_median": statistics.median(quiet) if quiet else None,
        "step_s_median_while_writing": statistics.median(busy) if busy else None,
    }


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'config':<10} {'GB':>7} {'sync save s':>12} {'load cold s':>12} {'load warm s':>12} "
        f"{'async stall s (1st, 2nd)':>25} {'async complete s':>17} {'step s / while writing':>23}"
    )
    for r in results:
        a = r["async_saves"]
        stalls = ", ".join(f"{s['stall_s']:.2f}" for s in a)
        done = ", ".join(f"{s['complete_s']:.1f}" if s["complete_s"] is not None else "-" for s in a)
        steps = f"{r['step_s_median'] or float('nan'):.3f} / {r['step_s_median_while_writing'] or float('nan'):.3f}"
        print(
            f"{r['config']:<10} {r['checkpoint_gb']:>7.2f} {r['sync_save_s']:>12.2f} {r['load_cold_s']:>12.2f} "
            f"{r['load_warm_s']:>12.2f} {stalls:>25} {done:>17} {steps:>23}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="gpt-1.3b,llama-3b")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (local disk)")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the synchronous save")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--async-interval",
        type=int,
        default=None,
        help="steps between the two asynchronous saves (default: enough to outlast the synchronous save); "
        "shorter makes the second save wait for the first (the log says how long)",
    )
    args = ap.parse_args()
    import torch

    from megatron.training.initialize import destroy

    out = args.out or os.path.join(
        os.environ.get("OUT") or os.path.join(ROOT, "bench_out"), "bench_checkpoint.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_checkpoint_") as root:
        for name in args.configs.split(","):
            log = os.path.join(root, f"{name}.log")
            try:
                with open(log, "w") as f, contextlib.redirect_stdout(f):
                    try:
                        row = bench_config(name, root, args.warmup, args.async_interval)
                    finally:
                        destroy()
            except Exception:
                print(open(log).read()[-5000:], flush=True)
                raise
            results.append(row)
            print(json.dumps(row), flush=True)
            shutil.copy(
                log, os.path.join(os.path.dirname(os.path.abspath(out)), f"bench_checkpoint_{name}.log")
            )
    print_table(results)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    with open(out, "w") as f:
        json.dump({"device": device, "results": results}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
