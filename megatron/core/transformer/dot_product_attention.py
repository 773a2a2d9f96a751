"""The core attention (Megatron-Core's ``megatron.core.transformer.dot_product_attention``): SDPA over
one rank's queries, keys and values; causal, a boolean mask, or packed documents (a DocumentMask)."""

from __future__ import annotations

import functools
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.document_mask import DocumentMask, varlen_attention, varlen_supported
from megatron.core.transformer.enums import AttnMaskType


@functools.lru_cache(maxsize=8)
def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """The causal mask ``[1, 1, s, s]`` bool in Megatron's convention (True = masked: key after query).
    Cached per (length, device); read-only."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)[None, None]


AttentionMask = torch.Tensor | DocumentMask | None


@overload
def mask_for_attention(attention_mask: torch.Tensor | None, seq_length: int) -> torch.Tensor | None: ...
@overload
def mask_for_attention(attention_mask: DocumentMask, seq_length: int) -> DocumentMask: ...
def mask_for_attention(attention_mask: AttentionMask, seq_length: int) -> AttentionMask:
    """Megatron's attention mask as the attention layers take it: ``None`` for plain causal attention
    (SDPA's fused ``is_causal`` path), a :class:`DocumentMask` as given (packed documents; its
    ``seq_length`` is the full sequence), otherwise the boolean ``[b or 1, 1, s, s]`` mask (True = masked).

    ``attention_mask`` may be ``[b, 1, s, s]``, ``[1, 1, s, s]`` or ``[b, s, s]``. It counts as causal
    when every ``[s, s]`` slice equals :func:`causal_mask`; that comparison reads the whole mask and,
    on a GPU, waits for the answer on the host (one sync per call, as the kernel depends on it). Pass
    ``None`` instead of a causal mask to skip it.

    Raises:
        ValueError: the mask is not boolean, or not one of the shapes above for ``s = seq_length``.
    """
    if attention_mask is None or isinstance(attention_mask, DocumentMask):
        return attention_mask
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"attention_mask must be a bool tensor (True = masked), got {attention_mask.dtype}; "
            "convert it with mask.bool()"
        )
    if attention_mask.dim() == 3:
        attention_mask = attention_mask.unsqueeze(1)  # [b, s, s] -> [b, 1, s, s]
    s = seq_length
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != (s, s):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected [b, 1, {s}, {s}], "
            f"[1, 1, {s}, {s}] or [b, {s}, {s}] for sequences of {s} tokens"
        )
    causal = causal_mask(s, attention_mask.device)
    if torch.equal(attention_mask, causal.expand_as(attention_mask)):
        return None
    return attention_mask


class DotProductAttention(nn.Module):
    """Causal (or masked) attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Inputs ``q`` ``[s, b, n_q, d]``, ``k``/``v`` ``[s, b, n_kv, d]`` with ``n_q`` a multiple of
    ``n_kv`` (grouped-query attention); output ``[s, b, n_q * d]``. ``attention_mask`` is ``None``
    (causal, the fused kernels' fast path) or a boolean ``[b or 1, 1, s, s]`` where True = masked, applied
    as given (:func:`mask_for_attention` turns a causal mask into ``None``), or a :class:`DocumentMask`
    (packed documents, block-diagonal causal): variable-length flash attention over the documents when
    :func:`~megatron.core.transformer.document_mask.varlen_supported` (CUDA, fp16/bf16), never an
    ``[s, s]`` mask; otherwise SDPA with the mask's cached dense form.

    Megatron-Core's arguments: ``attn_mask_type`` ``AttnMaskType.no_mask`` makes a ``None`` mask mean
    no masking (bidirectional); every other type keeps ``None`` = causal and applies a given mask as
    is. ``attention_dropout`` and ``softmax_scale`` override the config's (default ``1/sqrt(d)``).
    ``attention_type`` must be ``"self"``. ``cp_comm_type`` is accepted for Megatron-Core's signature;
    ``cp_groups`` of more than one rank is a ConfigError (one rank's attention; SelfAttention puts
    :class:`~megatron.core.transformer.context_parallel.attention.ContextParallelAttention` in this
    slot under context parallelism).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        rng_tracker: Any = None,
        cp_groups: Any = None,
    ) -> None:
        super().__init__()
        if attention_type != "self":
            raise ConfigError(
                f"DotProductAttention attention_type={attention_type!r}: only 'self' attention is "
                "built; use 'self'",
                params=("attention_type",),
            )
        if cp_groups is not None and cp_groups.size > 1:
            raise ConfigError(
                f"DotProductAttention attends over one rank's whole sequence; with "
                f"context_parallel_size {cp_groups.size} use ContextParallelAttention (SelfAttention "
                "builds it in this slot when given cp_groups of more than one rank)",
                params=("context_parallel_size",),
            )
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.rng_tracker = rng_tracker  # heads are split over tp: each rank draws its own mask
        self.softmax_scale = (
            getattr(config, "softmax_scale", None) if softmax_scale is None else softmax_scale
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: AttentionMask = None
    ) -> torch.Tensor:
        """``q`` ``[s, b, n_q, d]``, ``k`` / ``v`` ``[s, b, n_kv, d]`` -> ``[s, b, n_q * d]``."""
        if self.rng_tracker is not None and self.training and self.dropout_p > 0:
            with self.rng_tracker.fork():
                return self._attend(q, k, v, attention_mask)
        return self._attend(q, k, v, attention_mask)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: AttentionMask
    ) -> torch.Tensor:
        s, b, n_q, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(attention_mask, DocumentMask):
            if varlen_supported(q):
                out = varlen_attention(q, k, v, attention_mask, dropout_p, self.softmax_scale)
                return out.permute(2, 0, 1, 3).reshape(s, b, n_q * d)
            attention_mask = attention_mask.dense()
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=attention_mask is None and self.attn_mask_type != AttnMaskType.no_mask,
            enable_gqa=k.shape[1] != n_q,
            scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, n_q * d)
