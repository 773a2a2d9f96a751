"""Blockwise attention with the log-sum-exp: one query block against one key/value block, and the
merge of partial results. Context-parallel attention is built from these three functions.

Shapes: ``q`` ``[b, n_q, sq, d]``, ``k`` / ``v`` ``[b, n_kv, sk, d]`` with ``n_q`` a multiple of
``n_kv`` (query head ``h`` reads key/value head ``h // (n_q / n_kv)``). ``mask`` is ``None`` (every
query sees every key), ``"causal"`` (``sq == sk``, query ``i`` sees keys ``0..i``) or a boolean
``[b or 1, 1, sq, sk]`` tensor, True = masked (document masking). ``lse`` is ``[b, n_q, sq]`` fp32;
a query that sees no key has ``lse = -inf`` and output 0.

``block_backward`` takes the *merged* output and log-sum-exp of the rows (over every block the rows
attended to) and returns this block's share of the gradients: summed over the blocks, they are the
gradients of the whole attention.

Kernels (``block_kernel``): on CUDA in fp16/bf16, unmasked and causal blocks run SDPA's cuDNN attention
op (``aten._scaled_dot_product_cudnn_attention`` and its backward: it returns the log-sum-exp and takes
a given one) on Hopper and newer with cuDNN SDPA enabled, else PyTorch's flash attention ops
(``aten._flash_attention_forward`` / ``_backward``, which read grouped-query K/V themselves);
document-masked blocks run SDPA's memory-efficient op (``aten._scaled_dot_product_efficient_attention``
and its backward) with the block's mask as an additive bias. Everything else (CPU, fp32/fp64, head
sizes the kernels lack) runs the plain-torch math path, which materialises the ``[b, n_q, sq, sk]``
scores in fp32. The choice is recorded in docs/performance.md with the measurements behind it.
"""

from __future__ import annotations

import torch

Mask = torch.Tensor | str | None


def _expand_kv(x: torch.Tensor, n_q: int) -> torch.Tensor:
    n_kv = x.shape[1]
    return x if n_kv == n_q else x.repeat_interleave(n_q // n_kv, dim=1)


def _reduce_kv(g: torch.Tensor, n_kv: int) -> torch.Tensor:
    b, n_q, s, d = g.shape
    return g if n_q == n_kv else g.view(b, n_kv, n_q // n_kv, s, d).sum(2)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked_scores(q: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float) -> torch.Tensor:
    scores = torch.matmul(_acc(q), _acc(_expand_kv(k, q.shape[1])).transpose(-1, -2)) * scale
    if mask is None:
        return scores
    if isinstance(mask, str):
        assert mask == "causal", f"unknown block mask {mask!r}"
        sq, sk = scores.shape[-2:]
        masked = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
    else:
        masked = mask
    return scores.masked_fill(masked, float("-inf"))


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``, 0 on rows that see no key (``lse = -inf``)."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1))


Result = tuple[torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float) -> Result:
    """(out ``[b, n_q, sq, d]`` in q's dtype, lse ``[b, n_q, sq]`` fp32), in plain torch (fp32 math)."""
    scores = _masked_scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(_probs(scores, lse), _acc(_expand_kv(v, q.shape[1])))
    return out.to(q.dtype), lse


def math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
) -> Grads:
    """This block's (dq, dk, dv) given the rows' merged ``out`` and ``lse`` (see the module docstring)."""
    n_q, n_kv = q.shape[1], k.shape[1]
    p = _probs(_masked_scores(q, k, mask, scale), lse)  # [b, n_q, sq, sk]
    do = _acc(dout)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, _acc(_expand_kv(v, n_q)).transpose(-1, -2))
    delta = (do * _acc(out)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, _acc(_expand_kv(k, n_q))) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _acc(q)) * scale
    return dq.to(q.dtype), _reduce_kv(dk, n_kv).to(k.dtype), _reduce_kv(dv, n_kv).to(v.dtype)


def block_kernel(q: torch.Tensor, mask: Mask) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: the kernel a block of queries ``q`` with
    ``mask`` runs."""
    d = q.shape[-1]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256):
        return "math"
    if isinstance(mask, torch.Tensor):
        return "efficient" if torch.backends.cuda.is_built() and mask.shape[-1] % 16 == 0 else "math"
    if _cudnn_usable(q):
        return "cudnn"
    if torch.backends.cuda.is_flash_attention_available() and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    return "math"


def _cudnn_usable(q: torch.Tensor) -> bool:
    """cuDNN attention for this block: enabled, cuDNN present, Hopper or newer (where PyTorch's own SDPA
    prefers it), head size at most 128."""
    if not (torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available()):
        return False
    return q.shape[-1] <= 128 and torch.cuda.get_device_capability(q.device)[0] >= 9


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, d]`` -> the kernels' ``[b, s, n, d]`` view (last dimension contiguous)."""
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float) -> Result:
    """:func:`math_forward` by PyTorch's flash attention op (``mask`` None or ``"causal"``)."""
    sq, sk = q.shape[2], k.shape[2]
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        _bshd(q), _bshd(k), _bshd(v), None, None, sq, sk, 0.0, mask == "causal", False, scale=scale
    )
    return out.transpose(1, 2), lse


def flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
) -> Grads:
    """:func:`math_backward` by PyTorch's flash attention op (no dropout: the rng state is unused)."""
    sq, sk = q.shape[2], k.shape[2]
    empty = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _bshd(dout.to(q.dtype)), _bshd(q), _bshd(k), _bshd(v), _bshd(out.to(q.dtype)),
        lse.float().contiguous(), None, None, sq, sk, 0.0, mask == "causal", empty, empty, scale=scale,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float) -> Result:
    """:func:`math_forward` by SDPA's cuDNN attention op (``mask`` None or ``"causal"``; grouped K/V
    expanded)."""
    n_q = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, _expand_kv(k, n_q), _expand_kv(v, n_q), None, True, 0.0, mask == "causal", False, scale=scale
    )[:2]
    return out, lse.reshape(q.shape[:3])


def cudnn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
) -> Grads:
    """:func:`math_backward` by SDPA's cuDNN attention op."""
    n_q, n_kv, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    # the op reads ``out`` and ``dout`` in the layout its forward returns, [b, s, n, d]
    out, dout = (t.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2) for t in (out, dout))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, _expand_kv(k, n_q), _expand_kv(v, n_q), out, lse.float().unsqueeze(-1).contiguous(),
        seed, seed, None, None, None, sq, sk, 0.0, mask == "causal", scale=scale,
    )  # fmt: skip
    return dq, _reduce_kv(dk, n_kv), _reduce_kv(dv, n_kv)


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The boolean block mask as the efficient kernel's additive bias ``[b, n_q, sq, sk]``. Masked keys
    get half the dtype's lowest value, not -inf: a row with every key masked then has finite scores
    (its probabilities underflow to 0 in the backward, where -inf gives NaN); its forward result is
    replaced by the math path's (out 0, lse -inf)."""
    b, n_q, sq = q.shape[:3]
    low = torch.finfo(q.dtype).min / 2
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask, low)
    return bias.expand(b, n_q, sq, mask.shape[-1])


def efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float) -> Result:
    """:func:`math_forward` by SDPA's memory-efficient attention op with the block mask as a bias; rows
    that see no key get out 0 and lse -inf, as the math path gives."""
    assert isinstance(mask, torch.Tensor)
    n_q, sq = q.shape[1], q.shape[2]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand_kv(k, n_q), _expand_kv(v, n_q), _bias(mask, q), True, 0.0, False, scale=scale
    )
    blind = mask.all(-1).expand(lse.shape[0], n_q, sq)  # [b, n_q, sq]: rows with no visible key
    lse = lse[:, :, :sq].masked_fill(blind, float("-inf"))
    return out.masked_fill(blind.unsqueeze(-1), 0.0), lse


def efficient_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
) -> Grads:
    """:func:`math_backward` by SDPA's memory-efficient attention op (grouped K/V expanded, their
    gradients summed back over each group)."""
    assert isinstance(mask, torch.Tensor)
    n_q, n_kv, sq = q.shape[1], k.shape[1], q.shape[2]
    pad = -sq % 32  # the op's log-sum-exp rows are padded to a multiple of 32
    lse = torch.nn.functional.pad(lse.float(), (0, pad)).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    # the op reads ``out`` in the memory layout its forward returns, [b, s, n, d] (seen as [b, n, s, d])
    out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype), q, _expand_kv(k, n_q), _expand_kv(v, n_q), _bias(mask, q), out,
        lse, seed, seed, 0.0, [True, True, True, False], False, scale=scale,
    )  # fmt: skip
    return dq, _reduce_kv(dk, n_kv), _reduce_kv(dv, n_kv)


FORWARD = {
    "flash": flash_forward,
    "cudnn": cudnn_forward,
    "efficient": efficient_forward,
    "math": math_forward,
}
BACKWARD = {
    "flash": flash_backward,
    "cudnn": cudnn_backward,
    "efficient": efficient_backward,
    "math": math_backward,
}


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float) -> Result:
    """One block's (out, lse) with the kernel :func:`block_kernel` picks (see the module docstring)."""
    return FORWARD[block_kernel(q, mask)](q, k, v, mask, scale)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
) -> Grads:
    """One block's (dq, dk, dv) given the merged ``out`` / ``lse`` of its rows."""
    return BACKWARD[block_kernel(q, mask)](dout, q, k, v, out, lse, mask, scale)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two key sets from each set's (out, lse): ``lse`` is their
    log-sum-exp, ``out`` the outputs weighted by ``exp(lse_i - lse)``. ``out``/``lse`` None: the block's.
    Returns ``out`` in the accumulation dtype (fp32, fp64 for fp64; cast once at the end)."""
    if out is None or lse is None:
        return _acc(block_out), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).unsqueeze(-1)
    return _acc(out) * w_old + _acc(block_out) * w_new, new_lse
