#!/usr/bin/env python3
"""Time one optimizer step (fp32 main params, bf16 model copy, clipping active) on a model's tensor shapes.

    python bench/bench_optimizer.py --config llama-3b [--iters 10]

Variants: torch's fused AdamW with clipping as ``grad_scale`` followed by a multi-tensor copy into
the bf16 params (what ``--no-use-fused-adam`` style setups do), and our one-pass step
(megatron/core/optimizer/fused_adamw.py) compiled per tensor size and size-generic. Prints ms per step
and the effective memory bandwidth for the bytes each must move (30 bytes per parameter for one pass).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from cuda_timing import median_ms

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core.optimizer.fused_adamw import adamw_step  # noqa: E402

SHAPES = {  # (h, ffn, vocab, layers, q heads, kv heads, swiglu)
    "llama-3b": (3072, 8192, 128256, 26, 24, 8, True),
    "gpt-1.3b": (2048, 8192, 50304, 24, 16, 16, False),
}


def tensors(name: str) -> list[tuple[int, ...]]:
    h, f, v, layers, nq, nkv, swiglu = SHAPES[name]
    hd = h // nq
    per_layer = [(h,), ((nq + 2 * nkv) * hd, h), (h, h), (h,), ((2 if swiglu else 1) * f, h), (h, f)]
    return [(v, h), (h,)] + per_layer * layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3b", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    shapes = tensors(args.config)
    mains = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    models = [m.detach().bfloat16() for m in mains]
    for m in mains:
        m.grad = torch.randn_like(m)
    n = sum(m.numel() for m in mains)
    divisor = torch.tensor(2.0, device="cuda")
    results = {}
    opt = torch.optim.AdamW(mains, lr=1e-4, weight_decay=0.1, fused=True)

    def torch_fused():
        opt.grad_scale = divisor
        opt.step()
        del opt.grad_scale
        torch._foreach_copy_(models, mains)

    results["torch fused AdamW (grad_scale) + foreach copy"] = median_ms(torch_fused, args.iters, warmup=3)
    model_of = {id(m): p for m, p in zip(mains, models)}
    for dynamic in (False, True):
        ours = torch.optim.AdamW(mains, lr=1e-4, weight_decay=0.1, fused=True)
        label = f"one-pass AdamW, compiled {'size-generic' if dynamic else 'per size'}"
        results[label] = median_ms(
            lambda: adamw_step(ours, model_of, divisor, dynamic=dynamic), args.iters, warmup=3
        )  # noqa: B023
    print(f"{args.config}: {len(shapes)} tensors, {n / 1e9:.3f} B parameters")
    for label, ms in results.items():
        print(f"  {label:<50} {ms:8.2f} ms   {30 * n / ms / 1e9:6.2f} TB/s at 30 B/param")


if __name__ == "__main__":
    main()
