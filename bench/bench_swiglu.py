#!/usr/bin/env python3
"""SwiGLU backward on the GPU: Inductor's kernel against the hand-written Triton one, timed.

    python bench/bench_swiglu.py [--shapes 8192x8192,4096x14336] [--iters 20]

For fc1 outputs ``x = [gate; up]`` of ``[tokens, 2F]`` (bf16) and an incoming gradient ``[tokens, F]``:
  * ``inductor``: the backward Inductor generates for a compiled ``silu(gate) * up`` (what compiled
    layers ran before megatron/core/fusions/triton_kernels.py);
  * ``triton``: the library's ``SwiGLU`` under ``torch.compile``, whose backward is the Triton
    kernel (reads gate, up and the gradient once).
Both are checked against an fp32 reference; the copy-bandwidth time (three reads and two writes of
``tokens x F`` bf16 values at 4.3 TB/s) is printed beside them. Appends JSON lines to
``$OUT/bench_swiglu.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.fusions import triton_kernels  # noqa: E402


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _timed_backward(forward, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(dx, ms of the backward alone): the forward runs first, untimed."""
    xi = x.detach().requires_grad_()
    y = forward(xi)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y.backward(grad)
    end.record()
    torch.cuda.synchronize()
    return xi.grad, start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x8192,4096x14336", help="tokens x F (llama-3b, Llama-3-8B)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    # Inductor compiles the backward of the compiled forward (AOTAutograd), as in the compiled layers.
    variants = {"inductor": torch.compile(_swiglu), "triton": torch.compile(triton_kernels.SwiGLU.apply)}
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    print(f"{'shape':<12} {'variant':<9} {'ms':>8} {'bandwidth ms':>13} {'max rel err':>12}")
    for shape in args.shapes.split(","):
        tokens, f = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(tokens, 2 * f, device="cuda", generator=g) * 3).bfloat16()
        grad = torch.randn(tokens, f, device="cuda", generator=g).bfloat16()
        ref = triton_kernels._swiglu_backward_torch(grad, x).float()
        ideal_ms = 5 * tokens * f * 2 / 4.3e12 * 1e3
        for name, forward in variants.items():
            dx, _ = _timed_backward(forward, x, grad)
            err = ((dx.float() - ref).abs().max() / ref.abs().max()).item()
            times = sorted(_timed_backward(forward, x, grad)[1] for _ in range(args.iters))
            ms = times[len(times) // 2]
            print(f"{shape:<12} {name:<9} {ms:8.3f} {ideal_ms:13.3f} {err:12.2e}", flush=True)
            with open(os.path.join(out_dir, "bench_swiglu.jsonl"), "a") as fh:
                fh.write(json.dumps(dict(bench="swiglu_backward", shape=shape, variant=name, ms=ms,
                                         bandwidth_ms=ideal_ms, max_rel_err=err,
                                         gpu=torch.cuda.get_device_name())) + "\n")


if __name__ == "__main__":
    main()
