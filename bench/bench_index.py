#!/usr/bin/env python3
"""CPU benchmark: GPTDataset index build for a synthetic dataset of N tokens.

    python bench/bench_index.py --tokens 1e9 [--seq-length 4096] [--workdir /tmp/bench_index]

Writes a synthetic ``.idx`` with log-normal document lengths (mean ~600 tokens, like the
baseline's 1.67 M documents per 1e9 tokens) and a sparse ``.bin`` of the right size, then, in a
fresh process each, times (1) the index build with no cache (imports excluded and included) and
(2) the reload from cache, and reports the peak resident memory of each process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def make_idx(prefix: str, tokens: float, seed: int = 0) -> tuple[int, int]:
    import numpy as np

    from megatron.core.datasets.indexed_dataset import write_index

    rng = np.random.default_rng(seed)
    n_docs = int(tokens / 600)
    lengths = np.clip(rng.lognormal(mean=6.0, sigma=0.75, size=n_docs), 1, 2**20).astype(np.int32)
    lengths = (lengths * (tokens / lengths.sum(dtype=np.int64))).astype(np.int32) + 1
    write_index(prefix + ".idx", np.uint16, lengths, np.arange(n_docs + 1, dtype=np.int64))
    total = int(lengths.sum(dtype=np.int64))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(total * 2)  # sparse: nothing is read by the index build
    return n_docs, total


def child(prefix: str, cache: str, seq_length: int) -> None:
    t_import = time.perf_counter()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizer import NullTokenizer

    t0 = time.perf_counter()
    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=cache,
        tokenizer=NullTokenizer(50257),
        log=lambda _: None,
    )
    (ds, _, _) = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()
    t1 = time.perf_counter()
    print(
        json.dumps(
            {
                "samples": len(ds),
                "build_s": t1 - t0,
                "import_s": t0 - t_import,
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--workdir", default="/tmp/bench_index")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    if args.child:
        child(args.child[0], args.child[1], args.seq_length)
        return
    os.makedirs(args.workdir, exist_ok=True)
    prefix = os.path.join(args.workdir, f"synthetic_{args.tokens:.0e}")
    cache = os.path.join(args.workdir, f"cache_{args.tokens:.0e}")
    subprocess.run(["rm", "-rf", cache], check=True)
    n_docs, total = make_idx(prefix, args.tokens)
    print(f"synthetic dataset: {n_docs} documents, {total} tokens, seq length {args.seq_length}")
    for label in ("no cache", "reload from cache"):
        cmd = [sys.executable, __file__, "--seq-length", str(args.seq_length), "--child", prefix, cache]
        start = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{label:>18}: {r['samples']} samples, index build {r['build_s']:.2f} s "
            f"(imports {r['import_s']:.2f} s), process wall {time.time() - start:.2f} s, "
            f"peak RSS {r['peak_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
