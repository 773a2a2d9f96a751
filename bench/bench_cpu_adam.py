#!/usr/bin/env python3
"""Elements per second of the CPU AdamW kernels that --optimizer-cpu-offload can step with.

    python bench/bench_cpu_adam.py [--numel 50000000] [--num-tensors 1] [--iters 5] [--threads N]

Every variant updates fp32 params with fp32 gradients, clipping active (gradients divided by a
divisor of 2), the way the offloaded step does on the host: torch's ``AdamW(fused=True)`` (the
divisor as its ``grad_scale``), ``AdamW(foreach=True)`` and the single-tensor loop (``foreach=False``,
torch.optim.AdamW as built for CPU tensors, the divisor applied by one multi-tensor multiply first),
and our one-pass step (megatron/core/optimizer/fused_adamw.py) run eagerly, which also writes a bf16
copy. Prints the median ms per step and elements/s, and appends one JSON line to
``$OUT/bench_cpu_adam.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core.optimizer.fused_adamw import adamw_step  # noqa: E402

HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_tensors(numel: int, num_tensors: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """``num_tensors`` fp32 params (with gradients) of ``numel`` elements in all, and bf16 copies."""
    sizes = [numel // num_tensors] * num_tensors
    sizes[-1] += numel - sum(sizes)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params, [p.detach().bfloat16() for p in params]


def torch_step(kind: str, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    opt = torch.optim.AdamW(params, **HYPER, **flags)
    divisor = torch.tensor(2.0)
    grads = [p.grad for p in params if p.grad is not None]

    def step() -> None:
        if kind == "fused":
            opt.grad_scale = divisor  # type: ignore[attr-defined]  # read by torch's fused kernel
            opt.step()
        else:
            torch._foreach_mul_(grads, 1.0 / divisor)
            opt.step()

    return step


def one_pass_step(params: list[torch.nn.Parameter], models: list[torch.Tensor]) -> Callable[[], None]:
    opt = torch.optim.AdamW(params, **HYPER, foreach=True)
    model_of = {id(p): m for p, m in zip(params, models)}
    divisor = torch.tensor(2.0)

    def step() -> None:
        adamw_step(opt, model_of, divisor, compile=False)

    return step


def median_ms(step: Callable[[], None], iters: int) -> float:
    step()  # creates the state
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--num-tensors", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--variants", default="fused,foreach,for-loop,one-pass")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    row: dict[str, object] = {
        "numel": args.numel,
        "num_tensors": args.num_tensors,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(
        f"{'variant':<10} {'ms/step':>9} {'Melem/s':>9}   ({args.numel} elements, {row['threads']} threads)"
    )
    for kind in args.variants.split(","):
        params, models = make_tensors(args.numel, args.num_tensors)
        step = one_pass_step(params, models) if kind == "one-pass" else torch_step(kind, params)
        ms = median_ms(step, args.iters)
        row[kind] = {"ms": ms, "elements_per_s": args.numel / (ms / 1000.0)}
        print(f"{kind:<10} {ms:9.1f} {args.numel / ms / 1000.0:9.1f}", flush=True)
        del params, models, step
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_cpu_adam.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
