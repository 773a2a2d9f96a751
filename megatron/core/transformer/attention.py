"""Self-attention: fused QKV projection (GQA-aware), RoPE, SDPA core attention, output projection."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size
from megatron.core.tensor_parallel.random import checkpoint_with_rng
from megatron.core.transformer.document_mask import DocumentMask, varlen_attention, varlen_supported
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.rope import apply_rotary
from megatron.core.transformer.spec_utils import build_module

Rotary = tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class SelfAttentionSubmodules:
    """The attention's submodules (classes or specs): the QKV and output projections, the core
    attention (``DotProductAttention``: SDPA; a context-parallel attention plugs in here) and the
    optional query/key norms."""

    linear_qkv: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    k_layernorm: Any = None


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
    ``attention_type`` must be ``"self"``. ``cp_groups`` of more than one rank (the model's context
    parallelism) makes this the context-parallel attention
    (:class:`~megatron.core.transformer.context_parallel.attention.ContextParallelAttention`) with
    ``cp_comm_type`` (default: the config's), as Megatron-Core's Transformer Engine attention does.
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
        self.context_parallel: nn.Module | None = None
        if cp_groups is not None and cp_groups.size > 1:
            from megatron.core.transformer.context_parallel.attention import ContextParallelAttention

            self.context_parallel = ContextParallelAttention(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout,
                softmax_scale,
                cp_comm_type,
                rng_tracker,
                cp_groups,
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
        if self.context_parallel is not None:
            out: torch.Tensor = self.context_parallel(q, k, v, attention_mask)
            return out
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


def _qk_norm(spec: Any, config: Any, head_dim: int) -> nn.Module | None:
    """A query/key norm of ``head_dim`` channels, or None (see SelfAttention)."""
    asked = config.qk_layernorm or bool(getattr(spec, "metainfo", {}).get("qk_layernorm"))
    if spec is None or not asked or spec is IdentityOp:
        return None
    norm: nn.Module = build_module(spec, config, head_dim)
    return norm


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with heads split across the tp group.

    The fused QKV weight stacks, per query group, ``[n_h/n_g query heads, 1 key head, 1 value head]``
    of ``d`` rows each (Megatron's checkpoint layout); tp splits along query groups.

    Query/key norms are built from ``submodules.q_layernorm`` / ``k_layernorm`` when
    ``config.qk_layernorm`` is set or the spec asked for them (``get_gpt_layer_local_spec(
    qk_layernorm=True)``); an ``IdentityOp`` there is no norm. ``attn_mask_type`` goes to the core
    attention, and ``cp_groups`` (context parallelism) too, only when given.
    """

    def __init__(
        self,
        config: Any,
        submodules: SelfAttentionSubmodules,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng_tracker: Any = None,
        cp_groups: Any = None,
    ) -> None:
        super().__init__()
        tp = group_size(tp_group)
        n_h, n_g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        for what, n in (("num_attention_heads", n_h), ("num_query_groups", n_g)):
            if n % tp != 0:
                raise ConfigError(
                    f"{what} {n} is not divisible by tensor_model_parallel_size {tp}",
                    params=(what, "tensor_model_parallel_size"),
                )
        self.heads_per_group = n_h // n_g
        self.num_groups_local = n_g // tp
        self.head_dim = d
        self.rotary = config.position_embedding_type == "rope"
        common = dict(
            tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=config.params_dtype
        )
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            (n_h + 2 * n_g) * d,
            init_std=config.init_method_std,
            bias=config.add_bias_linear or config.add_qkv_bias,
            **common,
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config,
            layer_number,
            attn_mask_type=attn_mask_type,
            rng_tracker=rng_tracker,
            **({} if cp_groups is None else {"cp_groups": cp_groups}),
        )
        self.rng_tracker = rng_tracker
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.linear_proj = build_module(
            submodules.linear_proj,
            n_h * d,
            config.hidden_size,
            init_std=config.output_layer_init_std,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            **common,
        )
        self.q_layernorm = _qk_norm(submodules.q_layernorm, config, d)
        self.k_layernorm = _qk_norm(submodules.k_layernorm, config, d)

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, rotary: Rotary = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` ``[s, b, h]`` -> ``(output [s, b, h], bias or None)``."""
        qkv, _ = self.linear_qkv(hidden)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups_local, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.head_dim)  # [s, b, n_q, d]
        k = qkv[:, :, :, self.heads_per_group]  # [s, b, n_kv, d]
        v = qkv[:, :, :, self.heads_per_group + 1]
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core_attention and self.training:
            context = checkpoint_with_rng(
                self.core_attention, q, k, v, attention_mask, tracker=self.rng_tracker
            )
        else:
            context = self.core_attention(q, k, v, attention_mask)
        out: tuple[torch.Tensor, torch.Tensor | None] = self.linear_proj(context)
        return out
