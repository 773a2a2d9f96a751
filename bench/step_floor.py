#!/usr/bin/env python3
"""The floor of a training step on one GPU: its GEMMs and attention alone, back to back.

    python bench/step_floor.py --configs gpt-1.3b,llama-3b [--iters 20] [--warmup 5] [--no-optimizer]
                               [--fp8] [--label NAME]

For a configuration of bench_gpt.py this replays, per step, exactly the matrix multiplications and
attention kernels a bf16 training step must run, with the step's shapes: per layer the QKV, output
projection, fc1 and fc2 GEMMs forward (bias in the GEMM's epilogue where the model has biases), their
input-gradient and weight-gradient GEMMs backward and cuDNN's fused attention forward and backward,
then the output layer's three GEMMs; with ``--fp8`` the layers' GEMMs run through
``torch._scaled_mm`` as the hybrid recipe runs them (the output layer stays bf16). Nothing else runs:
no norm, activation, residual add, cross entropy, quantisation or copy (the buffers hold random
values; the arithmetic is not chained). With the optimizer (default) the one-pass AdamW of
``megatron.core.optimizer.fused_adamw`` follows over every weight matrix (fp32 main params and
moments, bf16 gradients and model copy: the least traffic an fp32-master AdamW can have; biases and
norm weights, under 0.1% of the parameters, are left out). The median step time is the fastest any implementation using these kernels could train
at on this GPU, under its power limit: compare it with the whole step of bench_gpt.py (ours and the
baseline's) to see what is left for everything else. Prints the GPU's median SM clock and power
over the timed steps (nvidia-smi) and the kernel time by category of one profiled step; appends
JSON lines to ``$OUT/step_floor.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_gpt import CONFIGS, GpuMonitor  # noqa: E402

from megatron.training.profiling import categorize  # noqa: E402


def shape_of(name: str) -> dict:
    """The model shape of a bench_gpt.py configuration, from its flags."""
    flags = CONFIGS[name].split()

    def value(flag: str, default=None):
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    heads = value("--num-attention-heads")
    return dict(
        layers=value("--num-layers"),
        hidden=value("--hidden-size"),
        heads=heads,
        groups=value("--num-query-groups", heads),
        ffn=value("--ffn-hidden-size"),
        gated="--swiglu" in flags,
        bias="--disable-bias-linear" not in flags,
        seq=value("--seq-length"),
        batch=value("--micro-batch-size"),
        vocab=value("--vocab-size"),
    )


class Floor:
    """Weights, saved activations and gradient buffers of one step, and the step's GEMMs and attention."""

    def __init__(self, s: dict, device: torch.device, fp8: bool = False) -> None:
        bf16 = dict(device=device, dtype=torch.bfloat16)
        self.fp8 = fp8
        h, d = s["hidden"], s["hidden"] // s["heads"]
        self.s, self.d = s, d
        self.tokens = t = s["seq"] * s["batch"]
        qkv = (s["heads"] + 2 * s["groups"]) * d
        fc1 = s["ffn"] * (2 if s["gated"] else 1)
        shapes = {"qkv": (qkv, h), "proj": (h, h), "fc1": (fc1, h), "fc2": (h, s["ffn"])}

        def rand(*size):
            return torch.randn(*size, **bf16) * 0.02

        self.weights = [{k: rand(*v) for k, v in shapes.items()} for _ in range(s["layers"])]
        self.biases = [
            {k: rand(v[0]) if s["bias"] else None for k, v in shapes.items()} for _ in range(s["layers"])
        ]
        self.wgrads = [{k: torch.empty(*v, **bf16) for k, v in shapes.items()} for _ in range(s["layers"])]
        # What each layer's backward reads: the input of every GEMM, and q, k, v for attention.
        self.inputs = [
            {"qkv": rand(t, h), "proj": rand(t, h), "fc1": rand(t, h), "fc2": rand(t, s["ffn"])}
            for _ in range(s["layers"])
        ]
        self.embedding = rand(s["vocab"], h)
        self.embedding_grad = torch.empty_like(self.embedding)
        self.final = rand(t, h)
        self.out = {k: torch.empty(t, v[0], **bf16) for k, v in shapes.items()}
        # Attention's backward reads q, k and v: each layer keeps its own QKV output.
        self.qkv_out = [torch.empty(t, qkv, **bf16) for _ in range(s["layers"])]
        self.dout = {k: rand(t, v[0]) for k, v in shapes.items()}
        self.din = {k: torch.empty(t, v[1], **bf16) for k, v in shapes.items()}
        self.logits = torch.empty(t, s["vocab"], **bf16)
        self.dlogits = rand(t, s["vocab"])
        self.dfinal = torch.empty(t, h, **bf16)
        self.dattn = rand(s["batch"], s["seq"], s["heads"], d).transpose(1, 2)
        if fp8:
            self._fp8_operands()

    def _fp8_operands(self) -> None:
        """The layers' GEMM operands in fp8 and in both layouts ``torch._scaled_mm`` reads, as the hybrid
        recipe has them (e4m3 weights and inputs, e5m2 gradients), with values spread over each format's
        range as scaling puts them; the output layer stays bf16 (as in FP8 runs)."""
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

        def spread(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            t = t.float() * (torch.finfo(dtype).max / 8 / t.float().abs().max())  # amax lands at max / 8
            return t.to(dtype), t.t().contiguous().to(dtype)

        self.w8 = [{k: spread(w, e4m3) for k, w in layer.items()} for layer in self.weights]
        self.x8 = [{k: spread(x, e4m3) for k, x in layer.items()} for layer in self.inputs]
        self.dy8 = {k: spread(g, e5m2) for k, g in self.dout.items()}
        self.one = torch.ones((), device=self.final.device)

    def _mm8(self, a: torch.Tensor, b_t: torch.Tensor, fast_accum: bool) -> torch.Tensor:
        """``a @ b_t.t()`` for row-major fp8 ``a`` and ``b_t`` (bf16 out)."""
        return torch._scaled_mm(
            a,
            b_t.t(),
            scale_a=self.one,
            scale_b=self.one,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )

    def _qkv_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s, d = self.s, self.d
        b, n = s["batch"], s["seq"]
        q, k, v = buf.split([s["heads"] * d, s["groups"] * d, s["groups"] * d], dim=-1)
        return (
            q.view(b, n, s["heads"], d).transpose(1, 2),
            k.view(b, n, s["groups"], d).transpose(1, 2),
            v.view(b, n, s["groups"], d).transpose(1, 2),
        )

    def step(self) -> None:
        s = self.s
        graphs = []
        for i, (w, bias, x, qkv_out) in enumerate(zip(self.weights, self.biases, self.inputs, self.qkv_out)):
            for name in ("qkv", "proj", "fc1", "fc2"):
                if self.fp8:  # a fresh output from the caching allocator
                    out = self._mm8(self.x8[i][name][0], self.w8[i][name][0], fast_accum=True)
                else:
                    out = qkv_out if name == "qkv" else self.out[name]
                    if bias[name] is not None:
                        torch.addmm(bias[name], x[name], w[name].t(), out=out)
                    else:
                        torch.mm(x[name], w[name].t(), out=out)
                if name == "qkv":  # the QKV output feeds attention
                    q, k, v = (t.detach().requires_grad_() for t in self._qkv_views(out))
                    o = F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=s["groups"] != s["heads"]
                    )
                    graphs.append((o, q, k, v))
        torch.mm(self.final, self.embedding.t(), out=self.logits)
        torch.mm(self.dlogits, self.embedding, out=self.dfinal)
        torch.mm(self.dlogits.t(), self.final, out=self.embedding_grad)
        for i in reversed(range(s["layers"])):
            w, g, x, (o, q, k, v) = self.weights[i], self.wgrads[i], self.inputs[i], graphs[i]
            for name in ("fc2", "fc1", "proj", "qkv"):
                if name == "qkv":
                    torch.autograd.grad(o, (q, k, v), self.dattn)
                if self.fp8:
                    (dy8, dy8_t), (_, w8_t), (_, x8_t) = self.dy8[name], self.w8[i][name], self.x8[i][name]
                    self._mm8(dy8, w8_t, fast_accum=False)
                    self._mm8(dy8_t, x8_t, fast_accum=False)
                else:
                    torch.mm(self.dout[name], w[name], out=self.din[name])
                    torch.mm(self.dout[name].t(), x[name], out=g[name])


class Optimizer:
    """The one-pass AdamW over fp32 main copies of every weight, reading the bf16 weight gradients."""

    def __init__(self, floor: Floor) -> None:
        from megatron.core.optimizer.fused_adamw import adamw_step

        self.adamw_step = adamw_step
        model = [w for layer in floor.weights for w in layer.values()] + [floor.embedding]
        grads = [g for layer in floor.wgrads for g in layer.values()] + [floor.embedding_grad]
        for g in grads:
            g.normal_(0, 1e-3)
        mains = [w.float() for w in model]
        self.inner = torch.optim.AdamW(mains, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.model = {id(m): w for m, w in zip(mains, model)}
        self.grads = {id(m): g for m, g in zip(mains, grads)}
        self.divisor = torch.ones((), device=mains[0].device)

    def step(self) -> None:
        self.adamw_step(self.inner, self.model, self.divisor, grads=self.grads)


def timed(fn, iters: int, warmup: int) -> list[float]:
    """ms of each of ``iters`` calls of ``fn`` queued back to back, as training runs its steps (unlike
    cuda_timing.median_ms, which waits for the device after every call)."""
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def profile_by_category(fn) -> tuple[dict, dict]:
    """GPU kernel ms of one call of ``fn``, summed by category (megatron.training.profiling's), and the
    six kernels that took longest (ms)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            cat = categorize(e.name)
            by_cat[cat] = by_cat.get(cat, 0.0) + e.device_time / 1000.0
            by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + e.device_time / 1000.0
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:6])
    return (
        {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        {k: round(v, 2) for k, v in top.items()},
    )


def measure(
    name: str, device: torch.device, iters: int, warmup: int, with_optimizer: bool, fp8: bool = False
) -> dict:
    """The floor of configuration ``name``: GEMMs and attention, then with the optimizer step."""
    floor = Floor(shape_of(name), device, fp8)
    opt = Optimizer(floor) if with_optimizer else None

    def step():
        floor.step()
        if opt is not None:
            opt.step()

    with GpuMonitor() as monitor:
        gemm_attn = timed(floor.step, iters, warmup)
        whole = timed(step, iters, warmup) if opt is not None else gemm_attn
    by_category, top = profile_by_category(step)
    row = dict(
        bench="step_floor",
        config=name,
        gpu=torch.cuda.get_device_name(),
        gemm_attention_ms=statistics.median(gemm_attn),
        with_optimizer_ms=statistics.median(whole),
        optimizer=opt is not None,
        kernels_ms=by_category,
        top_kernels_ms=top,
        tokens=floor.tokens,
        **monitor.summary(),
    )
    row["tokens_per_s_at_floor"] = floor.tokens / row["with_optimizer_ms"] * 1000.0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="gpt-1.3b,llama-3b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-optimizer", action="store_true", help="GEMMs and attention only")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="the layers' GEMMs in FP8 (torch._scaled_mm, hybrid recipe, fast accumulation forward)",
    )
    ap.add_argument(
        "--label", default="", help="a name for this run's rows (e.g. the cuBLAS settings in the environment)"
    )
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda")
    for name in args.configs.split(","):
        row = {
            "label": args.label,
            "fp8": args.fp8,
            **measure(name, device, args.iters, args.warmup, not args.no_optimizer, args.fp8),
        }
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, "step_floor.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
