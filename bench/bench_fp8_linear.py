#!/usr/bin/env python3
"""FP8 linears, forward + backward: ours (torch._scaled_mm, tensorwise and delayed) against torchao's
float8 training and bf16, on llama-3b's four linear shapes.

    pip install --no-deps torchao           # .whl/ carries it to the GPU machine
    python bench/bench_fp8_linear.py [--iters 20] [--tokens 8192]

Issue 6 asks to choose the FP8 implementation "by measurement" among a well-kept library (torchao's
float8 training) and ``torch._scaled_mm`` directly (ours, megatron/core/fusions/fp8/). Each variant
runs ``y = x W^T`` and its backward under ``torch.compile`` (as in the compiled layers: quantisation
fused by Inductor) for QKV [5120, 3072], proj [3072, 3072], fc1 [16384, 3072] and fc2 [3072, 8192]
at 8192 tokens, bf16 in and out:

  * ``bf16``: ``F.linear``;
  * ``ours_tensorwise`` / ``ours_delayed``: :class:`Fp8Gemm` (hybrid: e4m3 forward, e5m2 gradients);
  * ``torchao_tensorwise`` / ``torchao_rowwise``: ``convert_to_float8_training`` of an ``nn.Linear``
    with the library's recipe of that name.

Reports the median ms per linear, the sum over the four (x 26 layers is llama-3b's per-step GEMM
work in the transformer layers) and the relative error of the output and input gradient against an
fp32 matmul. ``--small --device cpu`` checks the script itself (ours through its reference matmul
path; torchao's variants then fail and say why). Appends JSON lines to ``$OUT/bench_fp8_linear.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.fusions.fp8 import Fp8Gemm, Fp8Recipe  # noqa: E402
from megatron.core.fusions.triton import passed, self_check  # noqa: E402

SHAPES = {"qkv": (5120, 3072), "proj": (3072, 3072), "fc1": (16384, 3072), "fc2": (3072, 8192)}  # [N, K]


def _variant(name: str, weight: torch.Tensor, device: str):
    """``fn(x) -> y`` for one variant, using ``weight`` [N, K] (a leaf requiring grad) or its copy."""
    if name == "bf16":
        return torch.compile(lambda x: F.linear(x, weight)), [weight]
    if name.startswith("ours_"):
        kernels = passed(self_check(torch.device(device)))  # the Triton casts where their self-check passes
        gemm = Fp8Gemm(
            Fp8Recipe("hybrid", name.split("_", 1)[1], 1024),
            device=device,
            use_scaled_mm=device == "cuda",
            kernels=kernels,
        )
        return torch.compile(lambda x: gemm(x, weight, None)), [weight]
    if name.startswith("torchao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        lin = nn.Sequential(
            nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=weight.dtype)
        )
        with torch.no_grad():
            lin[0].weight.copy_(weight)
        convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(name.split("_", 1)[1]))
        return torch.compile(lin), [lin[0].weight]
    raise ValueError(name)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_shape(
    label: str, n: int, k: int, tokens: int, variants: list[str], iters: int, device: str
) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(tokens, k, device=device, generator=g).bfloat16()
    w0 = (torch.randn(n, k, device=device, generator=g) * 0.02).bfloat16()
    dy = torch.randn(tokens, n, device=device, generator=g).bfloat16()
    xr, wr = x0.float().requires_grad_(), w0.float().requires_grad_()
    out = xr @ wr.t()
    out.backward(dy.float())
    ref, ref_dx = out.detach(), xr.grad.detach()
    rel = lambda a, b: float((a.detach().float() - b).norm() / b.norm())  # noqa: E731
    rows = []
    for name in variants:
        try:
            weight = w0.clone().requires_grad_()
            fn, leaves = _variant(name, weight, device)
            times = []
            for i in range(iters + 3):
                x = x0.clone().requires_grad_()
                for t in leaves:
                    t.grad = None
                _sync(device)
                t0 = time.perf_counter()
                y = fn(x)
                y.backward(dy)
                _sync(device)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1000.0)
            rows.append(
                {
                    "bench": "fp8_linear",
                    "shape": label,
                    "n": n,
                    "k": k,
                    "tokens": tokens,
                    "variant": name,
                    "ms": statistics.median(times),
                    "rel_err_out": rel(y, ref),
                    "rel_err_dx": rel(x.grad, ref_dx),
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                }
            )
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is reported, the rest go on
            rows.append(
                {
                    "bench": "fp8_linear",
                    "shape": label,
                    "variant": name,
                    "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument(
        "--variants", default="bf16,ours_tensorwise,ours_delayed,torchao_tensorwise,torchao_rowwise"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="shapes / 32 and 64 tokens: a check of the script")
    args = ap.parse_args()
    shapes = {k: (n // 32, kk // 32) for k, (n, kk) in SHAPES.items()} if args.small else SHAPES
    tokens = 64 if args.small else args.tokens
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    variants = args.variants.split(",")
    totals: dict[str, float] = {}
    print(f"{'shape':<6} {'variant':<20} {'ms':>8} {'rel err y':>10} {'rel err dx':>11}")
    with open(os.path.join(out_dir, "bench_fp8_linear.jsonl"), "a") as f:
        for label, (n, k) in shapes.items():
            for r in run_shape(label, n, k, tokens, variants, args.iters, args.device):
                f.write(json.dumps(r) + "\n")
                if "error" in r:
                    print(f"{label:<6} {r['variant']:<20} failed: {r['error']}", flush=True)
                    totals[r["variant"]] = float("nan")
                    continue
                totals[r["variant"]] = totals.get(r["variant"], 0.0) + r["ms"]
                print(
                    f"{label:<6} {r['variant']:<20} {r['ms']:8.3f} {r['rel_err_out']:10.2e} {r['rel_err_dx']:11.2e}",
                    flush=True,
                )
        base = totals.get("bf16")
        for name, ms in totals.items():
            speedup = f"{base / ms:.2f}x bf16" if base and ms == ms and ms > 0 else "-"
            print(f"four linears, {name:<20} {ms:8.3f} ms  ({speedup})")
            f.write(
                json.dumps({"bench": "fp8_linear_total", "variant": name, "ms": ms, "tokens": tokens}) + "\n"
            )


if __name__ == "__main__":
    main()
