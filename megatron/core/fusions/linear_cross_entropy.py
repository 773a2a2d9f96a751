"""Output layer and cross entropy in one op, over chunks of tokens, never holding the full logits.

``loss[t] = logsumexp_v(h_t . W_v) - h_t . W_{y_t}`` for hidden states ``h`` ``[N, H]`` and the
(tied) output weight ``W`` ``[V, H]``. The unfused path materialises ``[N, V]`` logits in the param
dtype, an fp32 copy, fp32 log-probs saved for backward and fp32 then bf16 gradients, all alive at
the start of backward (docs/performance.md, "Issue 6, first pass: compiled layers and a fused
output layer + cross entropy").

Here the tokens are processed ``chunk`` at a time, and the gradients are formed in the forward pass
while each chunk's logits are at hand (as Liger-Kernel's fused linear cross entropy does), so the
output-layer GEMM runs once instead of being recomputed in backward. Per chunk: the logits
``h_c W^T``; one fused pass gives the fp32 loss and overwrites them with ``dlogits = w_t (softmax -
onehot)``; then ``G_h[c] = dlogits W`` and ``G_W += dlogits^T h_c`` (with several chunks, fp32
accumulation inside the GEMM on CUDA; with one chunk, one GEMM in the param dtype).
Backward only scales: ``grad_h = s G_h`` and ``grad_W = s G_W``.

This needs the gradient reaching the per-token losses to be ``s * w_t`` for one scalar ``s`` (for
example ``sum(loss * loss_mask) / count``): ``w`` is the ``loss_weights`` argument (the loss mask,
default all ones). Backward checks this on the device and fails loudly otherwise. The softmax and
the reductions run in fp32, as ``F.cross_entropy(logits.float())`` does; logits and dlogits are in
the param dtype, as the unfused path's matmul outputs and input gradients are.

The caller chooses the implementation of the elementwise step (the execution plan, at start-up):
``use_triton`` runs the Triton kernel (one program per row: online log-sum-exp, then the gradient
in place; :mod:`.triton.cross_entropy`); otherwise the torch code, compiled on CUDA when
``compile`` is true (one kernel), eager elsewhere, with the same arithmetic. Tensor parallelism
(vocab-sharded logits) keeps using :mod:`megatron.core.tensor_parallel.cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.fusions.compile import MaybeCompiled
from megatron.core.fusions.triton.cross_entropy import (
    cross_entropy_grad_triton,
    loss_and_dlogits_,
    lse_and_picked,
)

# Target elements of one chunk's logits: 2^30 bf16 values is 2 GiB, overwritten in place by their
# gradient. Models whose tokens x vocabulary fit take one chunk: then the weight gradient is one GEMM
# in the param dtype, as in the unfused path, with no fp32 accumulator.
CHUNK_ELEMENTS = 1 << 30

# The torch code of the elementwise steps, under the names the tests and bench/ use.
_lse_and_picked = lse_and_picked
_loss_and_dlogits_ = loss_and_dlogits_


def _lse_and_target_logit(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[c, V]`` (any float dtype), ``target`` ``[c]`` -> fp32 ``(logsumexp, logits[target])``."""
    return lse_and_picked(logits.float(), target)


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad`` times the fp32 0-dim ``scale``, in fp32, rounded once to ``dtype``. Compiled on CUDA
    (one vectorised pass; eager ATen takes an unvectorised broadcasting path for a 0-dim tensor
    operand, and would round ``scale`` to bf16 first for a bf16 ``grad``)."""
    return (grad.float() * scale).to(dtype)


_lse_fn = MaybeCompiled(_lse_and_target_logit)
_loss_dlogits_fn = MaybeCompiled(loss_and_dlogits_)
_scaled_fn = MaybeCompiled(_scaled)


def _accumulate_wgrad(acc: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``acc += dlogits^T @ hidden`` with ``acc`` fp32 and the operands in a lower precision.

    On CUDA the GEMM accumulates into ``acc`` itself (``addmm`` with an fp32 output dtype); other
    devices have no mixed-dtype GEMM, so the product is formed in the operands' dtype and added.
    """
    if acc.dtype == dlogits.dtype:
        acc.addmm_(dlogits.t(), hidden)
    elif acc.is_cuda:
        torch.addmm(acc, dlogits.t(), hidden, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_((dlogits.t() @ hidden).to(acc.dtype))


def chunk_tokens(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: a power of two with about ``CHUNK_ELEMENTS`` logits, at least 1."""
    c = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    c = 1 << (c.bit_length() - 1)
    return min(c, num_tokens)


def _loss_and_dlogits(
    dl: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, use_triton: bool, compile: bool
) -> torch.Tensor:
    """The chunk's fp32 loss; overwrites its logits ``dl`` with their gradient (see the module docstring)."""
    if use_triton:
        return cross_entropy_grad_triton(dl, target, weights)
    out: torch.Tensor = _loss_dlogits_fn(dl, target, weights, compile=compile)
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: per-token fp32 loss and, when gradients are wanted, ``G_h`` and ``G_W`` for unit scale.
    Backward: ``s * G`` where ``grad_loss = s * loss_weights``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        loss_weights: torch.Tensor | None,
        chunk: int,
        use_triton: bool,
        compile: bool,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.compile = compile
        if not (need_h or need_w):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                lse, picked = _lse_fn(hidden[s:e] @ weight.t(), target[s:e], compile=compile)
                loss[s:e] = lse - picked
            return loss
        weights = loss_weights.float() if loss_weights is not None else torch.ones(n, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        single = chunk >= n
        grad_w = None
        if need_w and not single:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            dl = h @ weight.t()  # [c, V] logits, then (in place) their gradient
            loss[s:e] = _loss_and_dlogits(dl, target[s:e], weights[s:e], use_triton, compile)
            if grad_h is not None:
                torch.mm(dl, weight, out=grad_h[s:e])
            if need_w:
                if single:
                    grad_w = dl.t() @ h
                else:
                    assert grad_w is not None
                    _accumulate_wgrad(grad_w, dl, h)
        ctx.save_for_backward(grad_h, grad_w, weights)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, weights = ctx.saved_tensors
        g = grad_loss.float()
        scale = (g * weights).sum() / (weights * weights).sum().clamp(min=1e-30)
        residual = (g - scale * weights).abs().max()
        torch._assert_async(
            residual <= 1e-3 * scale.abs() + 1e-30,
            "linear_cross_entropy: the gradient of the per-token losses must be one scalar "
            "times loss_weights (GPTModel: pass loss_mask=; or --no-cross-entropy-loss-fusion)",
        )
        h_dtype, w_dtype = ctx.dtypes
        out_h = _scaled_fn(grad_h, scale, h_dtype, compile=ctx.compile) if grad_h is not None else None
        out_w = _scaled_fn(grad_w, scale, w_dtype, compile=ctx.compile) if grad_w is not None else None
        return out_h, out_w, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk: int | None = None,
    loss_weights: torch.Tensor | None = None,
    *,
    use_triton: bool = False,
    compile: bool = False,
) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight.T`` against ``target``, chunked over tokens.

    Args:
        hidden: ``[..., H]`` final hidden states (the output layer's input).
        weight: ``[V, H]`` output-layer (or tied embedding) weight, same dtype as ``hidden``.
        target: ``[...]`` token ids in ``[0, V)``.
        chunk: tokens per chunk (default :func:`chunk_tokens`).
        loss_weights: ``[...]`` like ``target``: the gradient reaching the returned losses must be
            one scalar times these (the loss mask); default all ones.
        use_triton: the loss/gradient pass is the Triton kernel (the plan's ``cross_entropy``
            kernel: CUDA tensors, or CPU ones under Triton's interpreter).
        compile: otherwise, the torch code's steps are compiled (CUDA tensors only; CPU stays eager).

    Returns:
        ``[...]`` fp32 losses, equal to ``F.cross_entropy((hidden @ weight.T).float(), target,
        reduction="none")`` up to summation order.

    Raises:
        ValueError: ``target`` or ``loss_weights`` does not have one entry per token of ``hidden``.
    """
    shape = target.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but target has {t.shape[0]}")
    if chunk is None:
        chunk = chunk_tokens(h.shape[0], weight.shape[0])
    w = None if loss_weights is None else loss_weights.reshape(-1)
    if w is not None and w.shape[0] != h.shape[0]:
        raise ValueError(f"loss_weights has {w.shape[0]} tokens but target has {h.shape[0]}")
    loss: torch.Tensor = _LinearCrossEntropy.apply(h, weight, t, w, chunk, use_triton, compile)
    return loss.view(shape)
