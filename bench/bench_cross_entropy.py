#!/usr/bin/env python3
"""The fused cross entropy's elementwise step on the GPU: variants of the loss/dlogits pass, timed.

    python bench/bench_cross_entropy.py [--shapes 8192x128256,16384x50304] [--iters 20]

The fused output layer + cross entropy (megatron/core/fusions/linear_cross_entropy.py) turns one
chunk's bf16 logits ``[c, V]`` into the fp32 per-token loss and overwrites them with
``w (softmax - onehot)``. That pass reads the logits twice (log-sum-exp, then the gradient) and
writes them once; at the device's copy bandwidth it would take about ``3 * 2 * c * V`` bytes / 4.3 TB/s.
Variants, each compiled with torch.compile as the library does:
  * ``inplace``: the library's step (one function; the gradient written over the logits);
  * ``out_of_place``: the same arithmetic returning a new gradient tensor (one more logits-sized buffer);
  * ``split``: log-sum-exp and target logit first, then an in-place pointwise pass with no column
    index (``exp(l - lse) * w``), then ``-w`` scattered at the targets;
  * ``triton``: the hand-written kernel (megatron/core/fusions/triton/cross_entropy.py), one program per row.
Each is checked against the eager reference (max abs difference of the gradient, loss equality) and
timed with CUDA events. Appends JSON lines to ``$OUT/bench_cross_entropy.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
from cuda_timing import median_ms

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.fusions import triton_kernels  # noqa: E402
from megatron.core.fusions.linear_cross_entropy import _loss_and_dlogits_, _lse_and_picked  # noqa: E402


def _out_of_place(logits, target, weights):
    lf = logits.float()
    lse, picked = _lse_and_picked(lf, target)
    prob = torch.exp(lf - lse.unsqueeze(-1))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    prob = torch.where(cols.unsqueeze(0) == target.unsqueeze(-1), prob - 1.0, prob)
    return lse - picked, (prob * weights.unsqueeze(-1)).to(logits.dtype)


def _scaled_softmax_(logits, lse, weights):
    logits.copy_(torch.exp(logits.float() - lse.unsqueeze(-1)) * weights.unsqueeze(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x128256,16384x50304")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    inplace = torch.compile(_loss_and_dlogits_)
    out_of_place = torch.compile(_out_of_place)
    lse_fn = torch.compile(_lse_and_picked)
    softmax_ = torch.compile(_scaled_softmax_)

    def split(logits, target, weights):
        lse, picked = lse_fn(logits.float(), target)
        softmax_(logits, lse, weights)
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits[rows, target] -= weights.to(logits.dtype)
        return lse - picked

    variants = {
        "inplace": lambda x, t, w: (inplace(x, t, w), x),
        "out_of_place": lambda x, t, w: out_of_place(x, t, w),
        "split": lambda x, t, w: (split(x, t, w), x),
        "triton": lambda x, t, w: (triton_kernels.cross_entropy_grad_triton(x, t, w), x),
    }
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    print(f"{'shape':<14} {'variant':<13} {'ms':>8} {'GB/s':>8} {'max |dgrad| err':>16}")
    for shape in args.shapes.split(","):
        c, v = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        base = torch.randn(c, v, device=dev, dtype=torch.bfloat16, generator=g) * 4
        target = torch.randint(0, v, (c,), device=dev, generator=g)
        weights = (torch.rand(c, device=dev, generator=g) > 0.1).float()
        ref = base.clone()
        ref_loss = _loss_and_dlogits_(ref, target, weights)
        for name, fn in variants.items():
            x = base.clone()
            loss, grad = fn(x, target, weights)
            err = (grad.float() - ref.float()).abs().max().item()
            loss_err = (loss - ref_loss).abs().max().item()
            ms = median_ms(
                functools.partial(fn, x, target, weights), args.iters, before=functools.partial(x.copy_, base)
            )
            gbps = 3 * base.numel() * base.element_size() / ms / 1e6
            rec = dict(
                bench="cross_entropy_step",
                shape=shape,
                variant=name,
                ms=ms,
                gb_per_s=gbps,
                max_grad_err=err,
                max_loss_err=loss_err,
                gpu=torch.cuda.get_device_name(),
            )
            print(f"{shape:<14} {name:<13} {ms:8.3f} {gbps:8.0f} {err:16.2e}", flush=True)
            with open(os.path.join(out_dir, "bench_cross_entropy.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            del x, grad


if __name__ == "__main__":
    main()
