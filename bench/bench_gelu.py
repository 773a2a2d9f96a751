#!/usr/bin/env python3
"""GELU forward and backward on the GPU: exact (erf) against the tanh approximation, timed.

    python bench/bench_gelu.py [--shapes 16384x8192] [--iters 30]

For fc1 outputs ``[tokens, F]`` (bf16; gpt-1.3b: 16384 x 8192) and an incoming gradient of the same
shape, each variant runs under ``torch.compile`` as in the compiled layers (Inductor generates the
forward and the backward kernel):
  * ``erf``: ``F.gelu(x)``, the exact GELU (``--no-bias-gelu-fusion``);
  * ``tanh``: ``F.gelu(x, approximate="tanh")``, Megatron-LM's bias-GELU formula (the default);
  * ``tanh.approx``: the same formula in a hand-written Triton kernel using the GPU's one-instruction
    ``tanh.approx.f32`` (about 11 bits) instead of libdevice's accurate tanh, forward and backward;
  * ``square``: ``x * x`` (one read and one write forward, two reads and one write backward), the
    memory-bound floor of the same traffic.
Each is checked against an fp64 reference of its own formula (max |difference| / max |reference|).
Appends JSON lines to ``$OUT/bench_gelu.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from cuda_timing import median_ms

K0 = math.sqrt(2.0 / math.pi)
K1 = 0.044715


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _gelu_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    t = _tanh_approx(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))
    tl.store(y_ptr + offs, (0.5 * x * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(g_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    t = _tanh_approx(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=mask)


class _TanhApproxGelu(torch.autograd.Function):
    BLOCK = 2048

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = torch.empty_like(x)
        _gelu_fwd_kernel[(triton.cdiv(x.numel(), _TanhApproxGelu.BLOCK),)](
            x, y, x.numel(), BLOCK=_TanhApproxGelu.BLOCK
        )
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        g = g.contiguous()
        dx = torch.empty_like(x)
        _gelu_bwd_kernel[(triton.cdiv(x.numel(), _TanhApproxGelu.BLOCK),)](
            g, x, dx, x.numel(), BLOCK=_TanhApproxGelu.BLOCK
        )
        return dx


def _tanh_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(K0 * x * (1.0 + K1 * x * x)))


VARIANTS = {
    "erf": (lambda x: F.gelu(x), lambda x: F.gelu(x)),
    "tanh": (lambda x: F.gelu(x, approximate="tanh"), _tanh_formula),
    "tanh.approx": (_TanhApproxGelu.apply, _tanh_formula),
    "square": (lambda x: x * x, lambda x: x * x),
}


def _measure(fn, formula, x: torch.Tensor, grad: torch.Tensor, iters: int) -> dict:
    """Forward and backward ms of ``fn`` (medians) and its errors against ``formula`` in fp64."""
    xi = x.detach().requires_grad_()
    y = fn(xi)
    y.backward(grad)
    x64 = x.double().requires_grad_()
    ref = formula(x64)
    ref.backward(grad.double())
    fwd_err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    bwd_err = ((xi.grad.double() - x64.grad).abs().max() / x64.grad.abs().max()).item()
    del x64, ref
    fwd_ms = median_ms(lambda: fn(x), iters)
    y = fn(xi)
    bwd_ms = median_ms(lambda: torch.autograd.grad(y, xi, grad, retain_graph=True), iters)
    return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_err=fwd_err, bwd_err=bwd_err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16384x8192", help="tokens x F (gpt-1.3b's fc1 output)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    print(
        f"{'shape':<12} {'variant':<12} {'fwd ms':>8} {'bwd ms':>8} {'fwd TB/s':>9} {'bwd TB/s':>9} "
        f"{'fwd err':>8} {'bwd err':>8}  (errors: max |diff| / max |ref| of the fp64 formula)"
    )
    for shape in args.shapes.split(","):
        tokens, f = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(tokens, f, device="cuda", generator=gen) * 2).bfloat16()
        grad = torch.randn(tokens, f, device="cuda", generator=gen).bfloat16()
        nbytes = x.numel() * x.element_size()
        for name, (fn, formula) in VARIANTS.items():
            row = _measure(fn if name == "tanh.approx" else torch.compile(fn), formula, x, grad, args.iters)
            fwd_tbs, bwd_tbs = 2 * nbytes / row["fwd_ms"] / 1e9, 3 * nbytes / row["bwd_ms"] / 1e9
            print(
                f"{shape:<12} {name:<12} {row['fwd_ms']:8.3f} {row['bwd_ms']:8.3f} {fwd_tbs:9.2f} {bwd_tbs:9.2f} "
                f"{row['fwd_err']:8.1e} {row['bwd_err']:8.1e}",
                flush=True,
            )
            with open(os.path.join(out_dir, "bench_gelu.jsonl"), "a") as fh:
                fh.write(
                    json.dumps(
                        dict(
                            bench="gelu",
                            shape=shape,
                            variant=name,
                            fwd_tb_s=fwd_tbs,
                            bwd_tb_s=bwd_tbs,
                            gpu=torch.cuda.get_device_name(),
                            **row,
                        )
                    )
                    + "\n"
                )


if __name__ == "__main__":
    main()
