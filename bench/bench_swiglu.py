#!/usr/bin/env python3
"""SwiGLU backward on the GPU: Inductor's kernel against the hand-written Triton one, timed.

    python bench/bench_swiglu.py [--shapes 8192x8192,4096x14336] [--iters 20]

For fc1 outputs ``x = [gate; up]`` of ``[tokens, 2F]`` (bf16) and an incoming gradient ``[tokens, F]``:
  * ``inductor``: the backward Inductor generates for a compiled ``silu(gate) * up`` (what compiled
    layers ran before megatron/core/fusions/triton/swiglu.py);
  * ``triton``: the library's ``SwiGLU`` under ``torch.compile``, whose backward is the Triton
    kernel (reads gate, up and the gradient once).
Both are checked against an fp32 reference; the copy-bandwidth time (three reads and two writes of
``tokens x F`` bf16 values at 4.3 TB/s) is printed beside them. Appends JSON lines to
``$OUT/bench_swiglu.jsonl`` (or ./bench_out/).

``--fp8``: the FP8 SwiGLU MLP's fused kernels (SwiGLU forward + e4m3 cast-transpose + amax; SwiGLU
backward + e5m2 cast-transpose + amax) under each tile of ``--tiles`` against the two passes they
replace (Inductor's SwiGLU or the Triton backward, then the cast-transpose kernel), with the fused
kernels' effective bandwidth; the fastest tile of each is written to ``$OUT/swiglu_fp8_tiles.txt``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cuda_timing import median_ms  # noqa: E402

from megatron.core.fusions import triton_kernels  # noqa: E402

FP8_TILES = "64x128x4,64x64x4,32x128x4,128x64x8,64x128x8,128x128x8,32x64x4,64x256x8"


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


def _fp8_runs(tokens: int, f: int) -> dict:
    """{pass: (the two passes apart, the fused kernel given a tile), bytes the fused kernel moves}."""
    tk = triton_kernels
    swiglu = torch.compile(tk.swiglu_fp32)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(tokens, 2 * f, device="cuda", generator=g) * 3).bfloat16()
    grad = torch.randn(tokens, f, device="cuda", generator=g).bfloat16()
    s4, s5 = torch.tensor(8.0, device="cuda"), torch.tensor(1000.0, device="cuda")
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    return {
        "forward": (
            lambda: tk.fp8_cast_transpose_triton(swiglu(x), s4, e4, True),
            lambda t: tk.swiglu_cast_transpose_amax_triton(x, s4, e4, t),
            tokens * f * (4 + 2),
        ),
        "backward": (
            lambda: tk.fp8_cast_transpose_triton(tk.swiglu_backward_triton(grad, x), s5, e5, True),
            lambda t: tk.swiglu_backward_cast_transpose_amax_triton(grad, x, s5, e5, t),
            tokens * f * (6 + 4),
        ),
    }


def fp8_tiles(shapes: str, tiles: str, iters: int, out_dir: str) -> None:
    """The two fused SwiGLU + fp8 cast-transpose kernels per tile against the two passes apart."""
    totals: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    print(f"{'shape':<12} {'pass':<9} {'variant':<12} {'ms':>8} {'TB/s':>6}")
    for shape in shapes.split(","):
        tokens, f = (int(v) for v in shape.split("x"))
        for name, (apart, fused, nbytes) in _fp8_runs(tokens, f).items():
            rows = [("two passes", median_ms(apart, iters, warmup=3), "")]
            for tile in tiles.split(","):
                ms = median_ms(
                    functools.partial(fused, tuple(int(v) for v in tile.split("x"))), iters, warmup=3
                )
                rows.append((tile, ms, f"{nbytes / ms / 1e9:6.2f}"))
                totals[name][tile] = totals[name].get(tile, 0.0) + ms
            for variant, ms, tbs in rows:
                print(f"{shape:<12} {name:<9} {variant:<12} {ms:8.3f} {tbs}", flush=True)
                with open(os.path.join(out_dir, "bench_swiglu.jsonl"), "a") as fh:
                    fh.write(
                        json.dumps(
                            dict(
                                bench="swiglu_fp8",
                                shape=shape,
                                kernel=name,
                                variant=variant,
                                ms=ms,
                                gpu=torch.cuda.get_device_name(),
                            )
                        )
                        + "\n"
                    )
    with open(os.path.join(out_dir, "swiglu_fp8_tiles.txt"), "w") as fh:  # least total time over the shapes
        for name, per_tile in totals.items():
            tile = min(per_tile, key=per_tile.__getitem__)
            print(f"fastest {name} tile: {tile}")
            fh.write(f"{name} {tile}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x8192,4096x14336", help="tokens x F (llama-3b, Llama-3-8B)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="time the fused SwiGLU + fp8 cast-transpose kernels")
    ap.add_argument(
        "--tiles", default=FP8_TILES, help="with --fp8: rows x columns x warps of each tile to time"
    )
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    if args.fp8:
        fp8_tiles(args.shapes, args.tiles, args.iters, out_dir)
        return
    # Inductor compiles the backward of the compiled forward (AOTAutograd), as in the compiled layers.
    variants = {"inductor": torch.compile(_swiglu), "triton": torch.compile(triton_kernels.SwiGLU.apply)}
    print(f"{'shape':<12} {'variant':<9} {'ms':>8} {'bandwidth ms':>13} {'max rel err':>12}")
    for shape in args.shapes.split(","):
        tokens, f = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(tokens, 2 * f, device="cuda", generator=g) * 3).bfloat16()
        grad = torch.randn(tokens, f, device="cuda", generator=g).bfloat16()
        ref = triton_kernels.swiglu_backward_torch(grad, x).float()
        ideal_ms = 5 * tokens * f * 2 / 4.3e12 * 1e3
        for name, forward in variants.items():
            dx, _ = _timed_backward(forward, x, grad)
            err = ((dx.float() - ref).abs().max() / ref.abs().max()).item()
            times = sorted(_timed_backward(forward, x, grad)[1] for _ in range(args.iters))
            ms = times[len(times) // 2]
            print(f"{shape:<12} {name:<9} {ms:8.3f} {ideal_ms:13.3f} {err:12.2e}", flush=True)
            with open(os.path.join(out_dir, "bench_swiglu.jsonl"), "a") as fh:
                fh.write(
                    json.dumps(
                        dict(
                            bench="swiglu_backward",
                            shape=shape,
                            variant=name,
                            ms=ms,
                            bandwidth_ms=ideal_ms,
                            max_rel_err=err,
                            gpu=torch.cuda.get_device_name(),
                        )
                    )
                    + "\n"
                )


if __name__ == "__main__":
    main()
