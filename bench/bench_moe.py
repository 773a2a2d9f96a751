#!/usr/bin/env python3
"""The mixture-of-experts layer alone on one GPU, timed: the expert loop against the grouped GEMM,
the allgather against the alltoall dispatcher, and the dense MLP of the same active size.

    python bench/bench_moe.py [--seq 4096 --batch 2 --hidden 2048 --ffn 5632 --experts 8 --topk 2]
    python bench/bench_moe.py --smoke     # tiny shapes, any device (checks the script runs)

``layer``: ``MoELayer`` forward + backward of ``hidden [s, b, h]`` (one rank: ep 1, etp 1, tp 1;
SwiGLU experts, no biases, aux loss 1e-2 as in Megatron-LM's Mixtral example) for each of
``--moe-grouped-gemm`` off / on x ``--moe-token-dispatcher-type`` allgather / alltoall.
``grouped_gemm_ran`` says whether ``torch._grouped_mm`` ran (``experts.grouped_gemm_applies``: bf16
on Hopper, or a CPU torch with the op); without it the loop ran. ``routing_only_fwd_bwd_ms`` is the
router, dispatch and combine with the experts left out (the rows go straight back), the layer's
overhead around the expert GEMMs. ``load_max_over_mean`` is the routing balance of the timed input
(random tokens and router weights: close to balanced, the best case for the loop).

``dense``: the dense SwiGLU ``MLP`` with ``ffn = topk x F`` (the same active parameters per token and
the same model FLOPs) on the same tokens.

TFLOP/s count the expert (or dense) GEMMs only: ``6 x T x k x 3 h F`` per forward + backward (the
router's ``[h, E]`` GEMM left out, as the trainer's FLOPs do). Appends JSON lines to
``$OUT/bench_moe.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cuda_timing import time_ms  # noqa: E402

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.experts import grouped_gemm_applies  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

SMOKE = dict(seq=16, batch=2, hidden=32, ffn=16, experts=4, topk=2, iters=1)


def make_config(args, dtype: torch.dtype, **moe: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 128),
        ffn_hidden_size=args.ffn,
        activation="swiglu",
        add_bias_linear=False,
        params_dtype=dtype,
        **moe,
    )


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_layer(args, device, dtype, grouped: bool, dispatcher: str, compiled: bool = False) -> dict:
    cfg = make_config(
        args,
        dtype,
        num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type=dispatcher,
    )
    layer = MoELayer(cfg, compile_helpers=compiled).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 0.02)
    shape = (args.seq, args.batch, args.hidden)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)

    layer.eval()  # a probe: no losses or statistics recorded
    with torch.no_grad():
        _, routing_map = layer.router(x)
        counts = routing_map.sum(0).float()  # [E]
        rows, _ = layer.token_dispatcher.token_dispatch(x.reshape(-1, args.hidden), *layer.router(x))
        w = (layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight)
        ran = grouped_gemm_applies(grouped, rows, w)
        layer.token_dispatcher.token_combine(rows)
    layer.train()

    def fwd() -> None:
        with torch.no_grad():
            layer(x)

    def fwd_bwd() -> None:
        out, _ = layer(x)
        out.backward(grad)

    def routing_only() -> None:
        tokens = x.reshape(-1, args.hidden)
        probs, rmap = layer.router(x)
        rows, _ = layer.token_dispatcher.token_dispatch(tokens, probs, rmap)
        layer.token_dispatcher.token_combine(rows).backward(grad.reshape(-1, args.hidden))

    reset_peak(device)
    ms = time_ms(fwd_bwd, args.iters, device)
    peak = peak_mib(device)
    row = {
        "bench": "layer",
        "experts_impl": "grouped" if grouped else "loop",
        "grouped_gemm_ran": ran,
        "dispatcher": dispatcher,
        "helpers": "compiled" if compiled else "eager",
        "fwd_ms": time_ms(fwd, args.iters, device),
        "fwd_bwd_ms": ms,
        "routing_only_fwd_bwd_ms": time_ms(routing_only, args.iters, device),
        "load_max_over_mean": float(counts.max() / counts.mean()),
        "peak_mib": peak,
    }
    moe_utils.clear_aux_losses_tracker()
    return row


def bench_dense(args, device, dtype, compiled: bool = False) -> dict:
    cfg = make_config(args, dtype)
    cfg.ffn_hidden_size = args.topk * args.ffn
    mlp = MLP(cfg, MLPSubmodules(ColumnParallelLinear, RowParallelLinear)).to(device)
    if compiled:
        mlp.compile(dynamic=False)  # as a compiled transformer layer runs it
    shape = (args.seq, args.batch, args.hidden)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def fwd() -> None:
        with torch.no_grad():
            mlp(x)

    def fwd_bwd() -> None:
        mlp(x)[0].backward(grad)

    reset_peak(device)
    ms = time_ms(fwd_bwd, args.iters, device)
    return {
        "bench": "dense",
        "dense_ffn": cfg.ffn_hidden_size,
        "helpers": "compiled" if compiled else "eager",
        "fwd_ms": time_ms(fwd, args.iters, device),
        "fwd_bwd_ms": ms,
        "peak_mib": peak_mib(device),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632, help="each expert's FFN size F")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any device): the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.seq * args.batch
    flops = 6 * tokens * args.topk * 3 * args.hidden * args.ffn  # expert GEMMs, forward + backward
    shape = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        seq=args.seq,
        batch=args.batch,
        hidden=args.hidden,
        ffn=args.ffn,
        experts=args.experts,
        topk=args.topk,
        tokens=tokens,
    )
    rows = []
    for dispatcher in ("allgather", "alltoall"):
        for grouped in (False, True):
            rows.append(bench_layer(args, device, dtype, grouped, dispatcher))
    compiled = device.type == "cuda"  # torch.compile'd kernels: CUDA only, as the trainer's plan
    if compiled:
        rows.append(bench_layer(args, device, dtype, True, "allgather", compiled=True))
    rows.append(bench_dense(args, device, dtype))
    if compiled:
        rows.append(bench_dense(args, device, dtype, compiled=True))
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_moe.jsonl"), "a") as f:
        for r in rows:
            r.update(shape)
            r["tokens_per_s"] = tokens / (r["fwd_bwd_ms"] / 1e3)
            r["tflops"] = flops / (r["fwd_bwd_ms"] / 1e3) / 1e12
            f.write(json.dumps(r) + "\n")
            name = r["bench"] + (f" {r['experts_impl']}/{r['dispatcher']}" if r["bench"] == "layer" else "")
            name += " compiled" if r["helpers"] == "compiled" else ""
            print(
                f"{name:<24} fwd {r['fwd_ms']:8.2f} ms  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  "
                f"{r['tokens_per_s']:12.0f} tok/s  {r['tflops']:7.1f} TFLOP/s",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
