"""Self-attention: fused QKV projection (GQA-aware), RoPE, SDPA core attention, output projection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size
from megatron.core.tensor_parallel.random import checkpoint_with_rng
from megatron.core.transformer.context_parallel.attention import ContextParallelAttention
from megatron.core.transformer.dot_product_attention import (  # noqa: F401 (re-exported: the old path)
    AttentionMask,
    DotProductAttention,
    causal_mask,
    mask_for_attention,
)
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


def _core_attention_for(spec: Any, cp_groups: Any) -> Any:
    """The core-attention slot's module: ``spec``, except that the one-rank ``DotProductAttention``
    becomes :class:`ContextParallelAttention` under context parallelism (cp groups of more than one
    rank), so Megatron-Core's local spec runs with any cp size."""
    if spec is DotProductAttention and cp_groups is not None and cp_groups.size > 1:
        return ContextParallelAttention
    return spec


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
            _core_attention_for(submodules.core_attention, cp_groups),
            config,
            layer_number,
            attn_mask_type=attn_mask_type,
            rng_tracker=rng_tracker,
            **({} if cp_groups is None else {"cp_groups": cp_groups}),
        )
        self.rng_tracker = rng_tracker
        self.recompute_core_attention = config.recompute_granularity == "selective" and "core_attn" in (
            config.recompute_modules or ("core_attn",)
        )
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
