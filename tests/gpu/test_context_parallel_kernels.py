"""Context-parallel block kernels on CUDA, run on the GPU machine:

    python -m pytest tests/gpu/test_context_parallel_kernels.py -q

Each GPU kernel (cuDNN and flash for unmasked and causal blocks, memory-efficient for document-masked ones)
against the fp32 math path on the same bf16 inputs: the block's output and log-sum-exp, and its
gradient share given merged results. Then the ring's block schedule, run in one process (every cp
rank's queries against every rank's key/value block, as the ring visits them), against full SDPA
at the rank's positions: forward and gradients, causal and packed documents, MHA and GQA. The CPU
suite skips this file; tests/distributed/test_context_parallel_attention.py covers the math path
over gloo.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.transformer.context_parallel import blocks, kernels
from megatron.core.transformer.context_parallel.layout import chunk_ids, local_token_indices
from megatron.core.transformer.document_mask import DocumentMask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16 = dict(device="cuda", dtype=torch.bfloat16)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def doc_ids(b, s, mean=40):
    """Document ids of ``b`` rows of ``s`` tokens, documents of ~``mean`` tokens."""
    starts = torch.rand(b, s, device="cuda") < 1.0 / mean
    starts[:, 0] = True
    return starts.long().cumsum(1)


def qkv(b, n_q, n_kv, sq, sk, d=128):
    torch.manual_seed(0)
    return (
        torch.randn(b, n_q, sq, d, **BF16),
        torch.randn(b, n_kv, sk, d, **BF16),
        torch.randn(b, n_kv, sk, d, **BF16),
    )


def test_block_kernel_choice():
    q = torch.zeros(1, 8, 64, 128, **BF16)
    mask = torch.zeros(1, 1, 64, 64, dtype=torch.bool, device="cuda")
    assert kernels.block_kernel(q, mask) == "efficient"
    assert kernels.block_kernel(q.float(), None) == "math"
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert kernels.block_kernel(q, "causal") == ("cudnn" if hopper else "flash")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert kernels.block_kernel(q, None) == "flash"


@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("kind", ["full", "causal", "cudnn full", "cudnn causal", "documents"])
def test_gpu_block_kernel_equals_math(kind, groups):
    b, n, s, d = 2, 8, 512, 128
    q, k, v = qkv(b, n, groups, s, s, d)
    if kind == "documents":
        ids = doc_ids(b, 2 * s)
        # queries from the second half, keys from the first: many query rows see no key of this block
        mask = DocumentMask(ids).block_mask(
            torch.arange(s, 2 * s, device="cuda"), torch.arange(s, device="cuda")
        )
        assert bool(mask.all(-1).any()) and not bool(mask.all())
        name = "efficient"
    else:
        mask = "causal" if kind.endswith("causal") else None
        name = "cudnn" if kind.startswith("cudnn") else "flash"
        if name == "cudnn" and torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("cuDNN attention blocks run on Hopper and newer")
    scale = d**-0.5
    out, lse = kernels.FORWARD[name](q, k, v, mask, scale)
    ref_out, ref_lse = kernels.math_forward(q, k, v, mask, scale)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel(out, ref_out) < 1e-2
    assert (out.float()[~seen] == 0).all()
    assert (lse[seen] - ref_lse[seen]).abs().max() < 2e-2
    # the backward share given the rows' merged results (here: this block is all the rows saw, rows
    # that saw nothing merged with a stand-in block so that their lse is finite, as in the ring)
    merged_lse = torch.where(seen, ref_lse, torch.zeros_like(ref_lse))
    dout = torch.randn_like(q)
    grads = kernels.BACKWARD[name](dout, q, k, v, ref_out, merged_lse, mask, scale)
    ref_grads = kernels.math_backward(dout, q, k, v, ref_out, merged_lse, mask, scale)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == r.shape
        assert rel(g, r) < 2e-2, ("dq dk dv"[3 * i : 3 * i + 2], rel(g, r))


def _ring_in_one_process(q, k, v, cp, doc_mask, scale):
    """Every cp rank's output and gradients by the ring's block schedule (no communication: rank r
    reads rank j's block directly). ``q``/``k``/``v`` ``[b, n, S, d]`` of the whole sequence."""
    s = q.shape[2]
    c = s // (2 * cp)
    ids = [list(chunk_ids(cp, j)) for j in range(cp)]
    idx = [local_token_indices(s, cp, j, "cuda") for j in range(cp)]
    local = [(q[:, :, i], k[:, :, i], v[:, :, i]) for i in idx]
    outs, lses = [], []
    for r in range(cp):
        out, lse = blocks.empty_result(local[r][0])
        for i in range(cp):
            j = (r - i) % cp
            blocks.attend(local[r][0], local[j][1], local[j][2], ids[r], ids[j], c, doc_mask, scale, out, lse)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    return idx, local, ids, c, outs, lses


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("documents", [False, True])
def test_ring_block_schedule_on_gpu_equals_full_attention(cp, groups, documents):
    b, n, s, d = 1, 8, 2048, 128
    q, k, v = qkv(b, n, groups, s, s, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = d**-0.5
    doc_mask = DocumentMask(doc_ids(b, s, mean=300)) if documents else None
    attn_mask = None if doc_mask is None else ~doc_mask.dense()
    full = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=doc_mask is None, enable_gqa=groups != n, scale=scale
    )
    dout = torch.randn_like(full)
    ref = torch.autograd.grad(full, (q, k, v), dout)
    with torch.no_grad():
        idx, local, ids, c, outs, lses = _ring_in_one_process(q, k, v, cp, doc_mask, scale)
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v))
        for r in range(cp):
            assert rel(outs[r], full[:, :, idx[r]]) < 1e-2
            g_q = torch.zeros(local[r][0].shape, dtype=torch.float32, device="cuda")
            for j in range(cp):
                g_k = torch.zeros(local[j][1].shape, dtype=torch.float32, device="cuda")
                g_v = torch.zeros_like(g_k)
                blocks.attend_backward(
                    dout[:, :, idx[r]], local[r][0], local[j][1], local[j][2], outs[r], lses[r], ids[r], ids[j],
                    c, doc_mask, scale, g_q, g_k, g_v,
                )  # fmt: skip
                dk[:, :, idx[j]] += g_k
                dv[:, :, idx[j]] += g_v
            dq[:, :, idx[r]] += g_q
    for i, (g, r) in enumerate(zip((dq, dk, dv), ref)):
        assert rel(g, r) < 2e-2, ("dq dk dv"[3 * i : 3 * i + 2], rel(g, r))
