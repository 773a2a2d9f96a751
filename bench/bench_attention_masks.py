#!/usr/bin/env python3
"""Attention for packed documents and the context-parallel block kernels on one GPU, timed.

    python bench/bench_attention_masks.py [--seqs 8192,16384] [--iters 10]
    python bench/bench_attention_masks.py --smoke     # tiny shapes, any device (checks the script runs)

``masks``: DotProductAttention forward + backward of one sequence (b 1, 32 query heads, 8 key/value
heads, head size 128, bf16) three ways: unmasked causal (SDPA's fused causal path), packed documents
through a DocumentMask (variable-length flash attention; documents of exponentially distributed
length, mean 1024 tokens) and SDPA with the same mask as a dense ``[S, S]`` boolean.

``blocks``: one context-parallel block (``c`` queries against ``c`` keys), forward + backward, with
each kernel of ``context_parallel.kernels`` that runs it (flash and cuDNN for unmasked and causal
blocks, memory-efficient for document-masked ones, fp32 math for all), for unmasked, causal and
document-masked blocks; public SDPA on its cuDNN backend (grouped K/V expanded, no log-sum-exp handed
out) on the same unmasked and causal blocks is printed beside them for reference.

``ring``: the compute of one cp rank under ring attention (its queries against every rank's block,
the ring's schedule, no communication: one GPU) for a sequence of ``--ring-seq`` tokens and cp 2, 4,
against one-GPU causal attention (cp 1) over the same per-GPU tokens. With communication this needs
several GPUs.

Appends JSON lines to ``$OUT/bench_attention_masks.jsonl`` (or ./bench_out/).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cuda_timing import time_ms  # noqa: E402

from megatron.core.transformer.context_parallel import blocks, kernels  # noqa: E402
from megatron.core.transformer.context_parallel.layout import chunk_ids, local_token_indices  # noqa: E402
from megatron.core.transformer.document_mask import DocumentMask  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def document_ids(s: int, mean: int, device: torch.device) -> torch.Tensor:
    """``[1, s]`` document ids: documents of exponentially distributed length (at least 16 tokens)."""
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.empty(s // 16 + 1).exponential_(1.0 / mean, generator=gen)).clamp(min=16).long()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:s]
    return ids[None].to(device)


def bench_masks(args, device, dtype, shape) -> list[dict]:
    n, g, d = shape
    rows = []
    for s in args.seqs:
        mask = DocumentMask(document_ids(s, args.doc_mean, device))
        cfg = TransformerConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n, num_query_groups=g)
        core = DotProductAttention(cfg, attention_dropout=0.0)
        q = torch.randn(s, 1, n, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(s, 1, g, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn(s, 1, n * d, device=device, dtype=dtype)
        row = {"bench": "masks", "seq": s, "heads": n, "groups": g, "head_dim": d, "doc_mean": args.doc_mean}
        row["documents"] = int(mask.doc_ids.max()) + 1
        for name, m in (("causal", None), ("document_mask", mask), ("dense_mask_sdpa", mask.dense())):
            step = functools.partial(_attention_step, core, q, k, v, m, dout)
            row[f"{name}_fwd_bwd_ms"] = round(time_ms(step, args.iters, device), 3)
        rows.append(row)
    return rows


def _attention_step(core, q, k, v, mask, dout) -> None:
    torch.autograd.grad(core(q, k, v, mask), (q, k, v), dout)


def _block_step(name, q, k, v, mask, scale, out, lse) -> None:
    kernels.FORWARD[name](q, k, v, mask, scale)
    kernels.BACKWARD[name](torch.ones_like(q), q, k, v, out, lse, mask, scale)


def _causal_step(q, k, v, scale) -> None:
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1], scale=scale
    )
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _block_inputs(c, shape, device, dtype):
    n, g, d = shape
    q = torch.randn(1, n, c, d, device=device, dtype=dtype)
    k = torch.randn(1, g, c, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v


def bench_blocks(args, device, dtype, shape) -> list[dict]:
    n, g, d = shape
    rows = []
    for c in args.chunks:
        q, k, v = _block_inputs(c, shape, device, dtype)
        scale = d**-0.5
        ids = document_ids(2 * c, args.doc_mean, device)
        doc = DocumentMask(ids).block_mask(
            torch.arange(c, 2 * c, device=device), torch.arange(c, device=device)
        )
        for kind, mask in (("full", None), ("causal", "causal"), ("documents", doc)):
            chosen = kernels.block_kernel(q, mask)
            # every GPU kernel that runs this block: flash and cuDNN both for unmasked and causal ones
            names = ["math"] + (
                [] if chosen == "math" else ["flash", "cudnn"] if chosen == "cudnn" else [chosen]
            )
            row = {"bench": "blocks", "chunk": c, "heads": n, "groups": g, "head_dim": d, "block": kind}
            for name in names:
                out, lse = kernels.FORWARD[name](q, k, v, mask, scale)
                lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

                step = functools.partial(_block_step, name, q, k, v, mask, scale, out, lse)
                row[f"{name}_fwd_bwd_ms"] = round(time_ms(step, args.iters, device), 3)
            if kind != "documents" and device.type == "cuda":
                row["sdpa_cudnn_fwd_bwd_ms"] = _sdpa_ms(q, k, v, kind == "causal", args.iters, device)
            rows.append(row)
    return rows


def _sdpa_ms(q, k, v, causal, iters, device) -> float | None:
    """SDPA forward + backward on the cuDNN backend (None where cuDNN attention does not run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    k2, v2 = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k2, v2, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    try:
        return round(time_ms(step, iters, device), 3)
    except RuntimeError:
        return None


def ring_rank_compute(q, k, v, cp, rank, scale) -> None:
    """Rank ``rank``'s forward + backward block work under ring attention with ``cp`` ranks."""
    s = q.shape[2]
    c = s // (2 * cp)
    ids = [list(chunk_ids(cp, j)) for j in range(cp)]
    idx = [local_token_indices(s, cp, j, q.device) for j in range(cp)]
    lq = q[:, :, idx[rank]]
    out, lse = blocks.empty_result(lq)
    order = [(rank - i) % cp for i in range(cp)]
    for j in order:
        blocks.attend(lq, k[:, :, idx[j]], v[:, :, idx[j]], ids[rank], ids[j], c, None, scale, out, lse)
    out = out.to(q.dtype)
    dq = torch.zeros(lq.shape, dtype=torch.float32, device=q.device)
    dout = torch.ones_like(lq)
    for j in order:
        kj, vj = k[:, :, idx[j]], v[:, :, idx[j]]
        dk, dv = (torch.zeros(kj.shape, dtype=torch.float32, device=q.device) for _ in range(2))
        blocks.attend_backward(dout, lq, kj, vj, out, lse, ids[rank], ids[j], c, None, scale, dq, dk, dv)


def bench_ring(args, device, dtype, shape) -> list[dict]:
    n, g, d = shape
    s = args.ring_seq
    scale = d**-0.5
    rows = []
    q = torch.randn(1, n, s, d, device=device, dtype=dtype)
    k = torch.randn(1, g, s, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    for cp in args.cps:
        local = s // cp
        # cp 1 at the same per-GPU tokens: causal attention over one sequence of s / cp tokens
        ql, kl, vl = (t[:, :, :local].detach().requires_grad_() for t in (q, k, v))
        one_gpu = functools.partial(_causal_step, ql, kl, vl, scale)

        row = {"bench": "ring", "seq": s, "cp": cp, "tokens_per_gpu": local, "heads": n, "groups": g}
        row["kernel"] = kernels.block_kernel(q, None)
        ms = time_ms(lambda cp=cp: ring_rank_compute(q, k, v, cp, 0, scale), args.iters, device)
        row["ring_rank_compute_ms"] = round(ms, 3)
        row["ring_rank_tokens_per_s"] = round(local / ms * 1e3)
        base = time_ms(one_gpu, args.iters, device)
        row["cp1_same_tokens_ms"] = round(base, 3)
        # the ring rank attends its tokens against s keys, cp 1 against s / cp: work ratio (2 cp - 1) / 1
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="8192,16384", help="sequence lengths of the masks bench")
    p.add_argument("--chunks", default="2048,4096", help="block sizes of the blocks bench")
    p.add_argument("--ring-seq", type=int, default=32768)
    p.add_argument("--cps", default="2,4")
    p.add_argument("--doc-mean", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--only", choices=("masks", "blocks", "ring"), default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, 2 iterations")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (32, 8, 128)
    if args.smoke:
        args.seqs, args.chunks, args.ring_seq, args.cps, args.doc_mean, args.iters = (
            "128",
            "64",
            256,
            "2",
            32,
            2,
        )
        shape = (4, 2, 16)
    args.seqs = [int(x) for x in str(args.seqs).split(",")]
    args.chunks = [int(x) for x in str(args.chunks).split(",")]
    args.cps = [int(x) for x in str(args.cps).split(",")]
    rows = []
    for name, fn in (("masks", bench_masks), ("blocks", bench_blocks), ("ring", bench_ring)):
        if args.only in (None, name):
            rows += fn(args, device, dtype, shape)
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    with open(os.path.join(out_dir, "bench_attention_masks.jsonl"), "a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")
            print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
