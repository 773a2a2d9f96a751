"""The fused cross entropy's per-row pass over ``[c, V]`` logits as one Triton program per row: an
online log-sum-exp (running max and rescaled sum), the target logit, the fp32 loss, then the gradient
``w (softmax - onehot)`` written over the logits (the second read of a row mostly hits L2). The torch
code that computes the same thing (:func:`loss_and_dlogits_`) is here too: the kernel's reference
and the fused cross entropy's path without Triton."""

from __future__ import annotations

import torch

from megatron.core.fusions.triton.common import compare, tl, triton

if triton is not None:

    @triton.jit
    def ce_grad_kernel(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        logits_ptr,
        stride,
        target_ptr,
        weight_ptr,
        loss_ptr,
        v,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(target_ptr + row)
        w = tl.load(weight_ptr + row).to(tl.float32)
        # Pass 1: online log-sum-exp. Per lane a running max and a sum rescaled to it.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            # Lanes that have seen only -inf keep 0 (exp(-inf - -inf) would be nan).
            acc = tl.where(new_m == float("-inf"), 0.0, acc * tl.exp(m - new_m) + tl.exp(x - new_m))
            m = new_m
        row_max = tl.max(m, 0)
        total = tl.sum(acc * tl.exp(m - row_max), 0)
        lse = row_max + tl.log(total)
        picked = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - picked)
        # Pass 2: the gradient over the logits, in place.
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < v
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == target, p - 1.0, p)
            tl.store(base + cols, (p * w).to(logits_ptr.dtype.element_ty), mask=mask)


def lse_and_picked(lf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp, lf[target])`` over the last dim of ``lf`` ``[c, V]``."""
    return torch.logsumexp(lf, dim=-1), lf.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def loss_and_dlogits_(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 per-token loss; overwrites ``logits`` with ``weights[:, None] * (softmax - onehot(target))``."""
    lf = logits.float()
    lse, picked = lse_and_picked(lf, target)
    prob = torch.exp(lf - lse.unsqueeze(-1))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    prob = torch.where(cols.unsqueeze(0) == target.unsqueeze(-1), prob - 1.0, prob)
    logits.copy_(prob * weights.unsqueeze(-1))
    return lse - picked


def cross_entropy_grad_triton(
    logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """:func:`loss_and_dlogits_` by the kernel (CUDA, or CPU under the interpreter): the fp32 per-row
    loss of ``logits [c, V]``, which are overwritten with ``weights[:, None] * (softmax - onehot)``."""
    assert logits.stride(-1) == 1, "cross_entropy_grad_triton needs logits with a contiguous last dim"
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    block = 4096 if v >= 4096 else triton.next_power_of_2(v)
    ce_grad_kernel[(c,)](
        logits,
        logits.stride(0),
        target.contiguous(),
        weights.float().contiguous(),
        loss,
        v,
        BLOCK=block,
        num_warps=16 if block >= 4096 else 4,
    )
    return loss


def check_cross_entropy(device: torch.device) -> str:
    """'' when the kernel matches the torch code on a small problem on ``device``, else what differs."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(16, 5000, device=device, generator=g) * 4).bfloat16()
    target = torch.randint(0, 5000, (16,), device=device, generator=g)
    weights = torch.ones(16, device=device)
    ref, got = logits.clone(), logits.clone()
    loss = cross_entropy_grad_triton(got, target, weights)
    return compare(loss, loss_and_dlogits_(ref, target, weights), tol=1e-4) or compare(got, ref)
