"""Output layer and cross entropy in one op, over chunks of tokens, never holding the full logits.

``loss[t] = logsumexp_v(h_t . W_v) - h_t . W_{y_t}`` for hidden states ``h`` ``[N, H]`` and the
(tied) output weight ``W`` ``[V, H]``. The unfused path materialises ``[N, V]`` logits in the param
dtype, an fp32 copy, fp32 log-probs saved for backward and fp32 then bf16 gradients: for llama-3b
(N = 8192, V = 128256) about 17 GB at the start of backward, when every activation is still alive.

Here the tokens are processed ``chunk`` at a time. Forward keeps only the per-token fp32 log-sum-exp
(``[N]``). Backward recomputes each chunk's logits (one extra ``[chunk, H] x [H, V]`` GEMM, a third of
the output layer's matmul work) and forms ``dlogits = g * (softmax - onehot)`` in one fused pass:
``grad_h = dlogits @ W`` and ``grad_W += dlogits^T @ h`` (fp32 accumulation over chunks). The softmax
and the reductions run in fp32, as ``F.cross_entropy(logits.float())`` does; logits and dlogits are
in the param dtype, as the unfused path's matmul outputs and input gradients are.

On CUDA the two elementwise steps are compiled (``torch.compile``, one kernel each); elsewhere, or if
compilation fails, they run eagerly with the same arithmetic. Tensor parallelism (vocab-sharded
logits) keeps using :mod:`megatron.core.tensor_parallel.cross_entropy`.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.compile import maybe_compiled

# Target elements of one chunk's logits: 2^28 fp32 values is 1 GiB.
CHUNK_ELEMENTS = 1 << 28


def _lse_and_target_logit(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[c, V]`` (any float dtype), ``target`` ``[c]`` -> fp32 ``(logsumexp, logits[target])``."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    picked = lf.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return lse, picked


def _dlogits(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad[:, None] * (softmax(logits) - onehot(target))`` in fp32, returned in ``logits.dtype``."""
    prob = torch.exp(logits.float() - lse.unsqueeze(-1))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    prob = torch.where(cols.unsqueeze(0) == target.unsqueeze(-1), prob - 1.0, prob)
    return (prob * grad.unsqueeze(-1)).to(logits.dtype)


_lse_fn = maybe_compiled(_lse_and_target_logit)
_dlogits_fn = maybe_compiled(_dlogits)


def chunk_tokens(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: a power of two with about ``CHUNK_ELEMENTS`` logits, at least 1."""
    c = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    c = 1 << (c.bit_length() - 1)
    return min(c, num_tokens)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: per-token fp32 loss; saves ``h``, ``W``, targets and the log-sum-exp.
    Backward: recomputes logits chunk by chunk; returns ``grad_h`` and ``grad_W`` in their dtypes."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits = hidden[s:e] @ weight.t()  # [c, V]
            c_lse, picked = _lse_fn(logits, target[s:e])
            lse[s:e] = c_lse
            loss[s:e] = c_lse - picked
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.shape[0]
        grad_loss = grad_loss.float().contiguous()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        single = chunk >= n
        grad_w = None if single or not need_w else torch.zeros(weight.shape, dtype=torch.float32,
                                                               device=weight.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            dl = _dlogits_fn(h @ weight.t(), lse[s:e], target[s:e], grad_loss[s:e])  # [c, V]
            if need_h:
                torch.mm(dl, weight, out=grad_h[s:e])
            if need_w:
                part = dl.t() @ h  # [V, H]
                if single:
                    grad_w = part
                else:
                    grad_w.add_(part)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight.T`` against ``target``, chunked over tokens.

    Args:
        hidden: ``[..., H]`` final hidden states (the output layer's input).
        weight: ``[V, H]`` output-layer (or tied embedding) weight, same dtype as ``hidden``.
        target: ``[...]`` token ids in ``[0, V)``.
        chunk: tokens per chunk (default :func:`chunk_tokens`).

    Returns:
        ``[...]`` fp32 losses, equal to ``F.cross_entropy((hidden @ weight.T).float(), target,
        reduction="none")`` up to summation order.
    """
    shape = target.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but target has {t.shape[0]}")
    if chunk is None:
        chunk = chunk_tokens(h.shape[0], weight.shape[0])
    return _LinearCrossEntropy.apply(h, weight, t, chunk).view(shape)
