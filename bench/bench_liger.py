#!/usr/bin/env python3
"""Liger-Kernel's Triton kernels against ours (Inductor-compiled or hand-written), forward + backward.

    pip install --no-deps liger-kernel          # .whl/ carries it to the GPU machine
    python bench/bench_liger.py [--iters 20] [--cases rmsnorm,add_rmsnorm,layernorm,rope,swiglu,linear_ce]

Issue 6 asks for fused norm, RoPE and activation kernels "chosen by measurement": Liger-Kernel is the
well-kept library of such kernels. Each case times forward + backward of the same computation, on
the shapes of llama-3b (tokens 8192, hidden 3072, 24 heads / 8 KV groups of 128, FFN 8192, vocab
128256) and gpt-1.3b (tokens 16384, hidden 2048, vocab 50304), bf16:

  * ``ours``: what the compiled layers run (torch.compile of the torch code; SwiGLU with our Triton
    backward; the fused output layer + cross entropy of megatron/core/fusions);
  * ``liger``: the matching ``liger_kernel.ops`` autograd Function.

RoPE: ours works on ``[s, b, n, d]`` (Megatron's layout); Liger on ``[b, n, s, d]``, contiguous (its
kernel-only time; in our layout a transposed copy would be added). Each result is checked against an
fp32 reference (max relative error of the outputs and input gradients); the peak memory of the step
is recorded too. Appends JSON lines to ``$OUT/bench_liger.jsonl`` (or ./bench_out/).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.fusions import triton_kernels  # noqa: E402
from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from megatron.core.transformer.rope import apply_rotary, rotary_cos_sin  # noqa: E402

EPS = 1e-5
DEVICE = "cuda"
# Shapes: tokens (llama, gpt), hidden (llama, gpt), FFN, vocab (llama, gpt), sequence, heads; --small shrinks
# them for a check of the script itself on a CPU (TRITON_INTERPRET=1 runs Liger's kernels there).
S = {
    "t": 8192,
    "tg": 16384,
    "h": 3072,
    "hg": 2048,
    "f": 8192,
    "v": 128256,
    "vg": 50304,
    "s": 4096,
    "nq": 24,
    "nk": 8,
}
SMALL = {"t": 64, "tg": 64, "h": 256, "hg": 128, "f": 128, "v": 512, "vg": 384, "s": 32, "nq": 4, "nk": 2}


def _rand(*shape, scale=1.0, grad=True):
    t = (torch.randn(*shape, device=DEVICE) * scale).bfloat16()
    return t.requires_grad_(grad)


def case_rmsnorm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    x, w = _rand(S["t"], S["h"]), _rand(S["h"], scale=0.1) + 1
    w = w.detach().requires_grad_()
    ours = torch.compile(lambda x, w: (F.rms_norm(x, (x.shape[-1],), w, EPS),))
    return (x, w), {
        "ours": ours,
        "liger": lambda x, w: (LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False),),
        "reference": lambda x, w: (F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS),),
    }


def case_add_rmsnorm():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    x, r, w = (
        _rand(S["t"], S["h"]),
        _rand(S["t"], S["h"]),
        (_rand(S["h"], scale=0.1) + 1).detach().requires_grad_(),
    )

    def torch_code(x, r, w):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), w, EPS), h

    return (x, r, w), {
        "ours": torch.compile(torch_code),
        "liger": lambda x, r, w: tuple(LigerFusedAddRMSNormFunction.apply(x, r, w, EPS)),
        "reference": lambda x, r, w: torch_code(x.float(), r.float(), w.float()),
    }


def case_layernorm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    x, w, b = (
        _rand(S["tg"], S["hg"]),
        (_rand(S["hg"], scale=0.1) + 1).detach().requires_grad_(),
        _rand(S["hg"], scale=0.1),
    )
    ours = torch.compile(lambda x, w, b: (F.layer_norm(x, (x.shape[-1],), w, b, EPS),))
    return (x, w, b), {
        "ours": ours,
        "liger": lambda x, w, b: (LigerLayerNormFunction.apply(x, w, b, EPS),),
        "reference": lambda x, w, b: (F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), EPS),),
    }


def case_rope():
    from liger_kernel.ops.rope import LigerRopeFunction

    s, b, nq, nk, d = S["s"], 2, S["nq"], S["nk"], 128
    q, k = _rand(s, b, nq, d), _rand(s, b, nk, d)
    cos, sin = rotary_cos_sin(torch.arange(s, device=DEVICE).expand(b, s), d, 500000.0)  # [s, b, 1, d]
    # Liger's layout: q, k [b, n, s, d] contiguous; cos, sin [1, s, d] (rotate-half, the same formula).
    qb = q.detach().permute(1, 2, 0, 3).contiguous().requires_grad_()
    kb = k.detach().permute(1, 2, 0, 3).contiguous().requires_grad_()
    cos_l, sin_l = cos[:, 0, 0].unsqueeze(0).contiguous(), sin[:, 0, 0].unsqueeze(0).contiguous()

    def torch_code(q, k):
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def liger(q, k):
        qo, ko = LigerRopeFunction.apply(qb, kb, cos_l, sin_l)
        return qo.permute(2, 0, 1, 3), ko.permute(2, 0, 1, 3)  # views back to [s, b, n, d] for the check

    return (
        (q, k),
        {
            "ours": torch.compile(torch_code),
            "liger": liger,
            "reference": lambda q, k: (apply_rotary(q.float(), cos, sin), apply_rotary(k.float(), cos, sin)),
        },
        {"liger": (qb, kb)},
    )


def case_swiglu():
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    y = _rand(S["t"], 2 * S["f"], scale=3.0)

    def reference(y):
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up,)

    return (y,), {
        "ours": torch.compile(lambda y: (triton_kernels.SwiGLU.apply(y),)),
        "liger": lambda y: (LigerFusedGateUpSiLUMulFunction.apply(y),),
        "reference": reference,
    }


def _linear_ce_case(tokens: int, hidden: int, vocab: int):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    h, w = _rand(tokens, hidden), _rand(vocab, hidden, scale=0.02)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)

    def reference(h, w):
        return (F.cross_entropy((h.float() @ w.float().t()), target),)

    ours = {
        "use_triton": triton_kernels.passed(triton_kernels.self_check(h.device)).uses("cross_entropy"),
        "compile": True,
    }  # as the execution plan resolves it on a GPU
    return (h, w), {
        "ours": lambda h, w: (linear_cross_entropy(h, w, target, **ours).mean(),),
        "liger": lambda h, w: (LigerFusedLinearCrossEntropyFunction.apply(h, w, target)[0],),  # (loss, ...)
        "reference": reference,
    }


CASES = {
    "rmsnorm": case_rmsnorm,
    "add_rmsnorm": case_add_rmsnorm,
    "layernorm": case_layernorm,
    "rope": case_rope,
    "swiglu": case_swiglu,
    "linear_ce": lambda: _linear_ce_case(S["t"], S["h"], S["v"]),
    "linear_ce_gpt": lambda: _linear_ce_case(S["tg"], S["hg"], S["vg"]),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_case(name: str, iters: int) -> list[dict]:
    built = CASES[name]()
    inputs, variants = built[0], built[1]
    own = built[2] if len(built) > 2 else {}  # variants that read their own (re-laid-out) leaves
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref_outs = variants["reference"](*ref_inputs)
    grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in ref_outs]
    torch.autograd.backward(ref_outs, grads)
    ref_grads = [t.grad for t in ref_inputs]
    rows = []
    for variant in ("ours", "liger"):
        fn, leaves = variants[variant], own.get(variant, inputs)
        outs = fn(*inputs)  # untimed: compiles, and gives the output dtypes
        out_grads = [g.to(o.dtype) for g, o in zip(grads, outs)]
        del outs
        times, cuda, peak = [], DEVICE == "cuda", 0.0
        for i in range(iters + 3):
            for t in leaves:
                t.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            outs = fn(*inputs)
            torch.autograd.backward(outs, out_grads)
            if cuda:
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1000.0)
        in_grads = [t.grad for t in leaves]
        if variant in own:  # Liger's RoPE layout [b, n, s, d] back to ours [s, b, n, d] for the check
            in_grads = [g.permute(2, 0, 1, 3) for g in in_grads]
        err_out = max(_rel(o, r) for o, r in zip(outs, ref_outs))
        err_grad = max(_rel(g, r) for g, r in zip(in_grads, ref_grads) if g is not None)
        rows.append(
            {
                "bench": "liger_vs_ours",
                "case": name,
                "variant": variant,
                "ms": statistics.median(times),
                "peak_extra_gib": peak,
                "rel_err_out": err_out,
                "rel_err_grad": err_grad,
                "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes on the CPU (with TRITON_INTERPRET=1): checks the script, times nothing useful",
    )
    args = ap.parse_args()
    global DEVICE
    if args.small:
        DEVICE = "cpu"
        S.update(SMALL)
    out_dir = os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    print(
        f"{'case':<14} {'variant':<7} {'ms':>8} {'peak extra GiB':>15} {'rel err out':>12} {'rel err grad':>13}"
    )
    with open(os.path.join(out_dir, "bench_liger.jsonl"), "a") as f:
        for name in args.cases.split(","):
            try:
                rows = run_case(name, args.iters)
            except Exception as exc:  # noqa: BLE001 - one failing case (API drift, OOM) must not end the others
                print(f"{name:<14} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            for r in rows:
                f.write(json.dumps(r) + "\n")
                print(
                    f"{r['case']:<14} {r['variant']:<7} {r['ms']:8.3f} {r['peak_extra_gib']:15.2f} "
                    f"{r['rel_err_out']:12.2e} {r['rel_err_grad']:13.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
