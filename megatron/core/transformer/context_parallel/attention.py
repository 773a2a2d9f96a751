"""Context-parallel core attention: the core-attention slot's module when the sequence is split over
cp ranks (see ``layout``). The comm type picks how keys and values reach the queries: ``p2p``
(:mod:`ring`), ``a2a`` and ``a2a+p2p`` (:mod:`all_to_all`), ``allgather`` (:mod:`all_gather`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.context_parallel.all_gather import all_gather_attention
from megatron.core.transformer.context_parallel.all_to_all import hierarchical_attention, ulysses_attention
from megatron.core.transformer.context_parallel.layout import (
    ContextParallelGroups,
    chunk_ids,
    comm_type_of_layer,
)
from megatron.core.transformer.context_parallel.ring import ring_attention
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

# (q, k, v [s_l, b, n, d], document mask or None, softmax scale) -> [s_l, b, n_q, d]
Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, float], torch.Tensor]


class ContextParallelAttention(nn.Module):
    """Causal attention of this cp rank's queries over the whole sequence's keys and values.

    Inputs are this rank's tokens (its two chunks, ``layout.local_token_indices`` order): ``q``
    ``[s_local, b, n_q, d]``, ``k`` / ``v`` ``[s_local, b, n_kv, d]``; output ``[s_local, b, n_q * d]``.
    ``attention_mask`` is None (causal over the global sequence) or a
    :class:`~megatron.core.transformer.document_mask.DocumentMask` of the full sequence. The output
    equals full causal attention of the whole sequence restricted to this rank's query rows.

    Raises (construction):
        ConfigError: ``attention_dropout`` > 0 (not built with context parallelism); for ``a2a`` the
            local heads or query groups not divisible by ``context_parallel_size`` (for ``a2a+p2p`` by
            the level-0 size); ``a2a+p2p`` without two hierarchical cp groups.
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
        cp_groups: ContextParallelGroups | None = None,
    ) -> None:
        super().__init__()
        assert cp_groups is not None, "ContextParallelAttention needs cp_groups"
        self.cp_groups = cp_groups
        self.comm_type = cp_comm_type or comm_type_of_layer(
            getattr(config, "cp_comm_type", None), layer_number, config.num_layers
        )
        self.softmax_scale = (
            getattr(config, "softmax_scale", None) if softmax_scale is None else softmax_scale
        )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ConfigError(
                f"attention_dropout {dropout} is not supported with context_parallel_size "
                f"{cp_groups.size} > 1; pass attention_dropout 0",
                params=("attention_dropout", "context_parallel_size"),
            )
        self._attend: Impl = self._build(config, layer_number, attn_mask_type)

    def _build(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType) -> Impl:
        groups, n = self.cp_groups, self.cp_groups.size
        if self.comm_type == "p2p":
            ids = [list(chunk_ids(n, j)) for j in range(n)]
            return functools.partial(_ring, group=groups.group, q_ids=ids[groups.rank], kv_ids_of=ids)
        if self.comm_type == "allgather":
            return functools.partial(_all_gather, group=groups.group)
        if self.comm_type == "a2a":
            _check_heads(config, n, "context_parallel_size")
            local = DotProductAttention(config, layer_number, attn_mask_type, "self", 0.0, self.softmax_scale)
            return functools.partial(_ulysses, group=groups.group, local_attention=local)
        assert self.comm_type == "a2a+p2p", f"unknown cp comm type {self.comm_type!r}"
        if len(groups.hierarchical) != 2 or any(g is None for g in groups.hierarchical):
            raise ConfigError(
                "cp_comm_type 'a2a+p2p' needs two hierarchical context-parallel levels; set "
                "hierarchical_context_parallel_sizes to [a, cp / a] (e.g. [2, "
                f"{max(n // 2, 1)}])",
                params=("hierarchical_context_parallel_sizes", "cp_comm_type"),
            )
        a2a_group, ring_group = groups.hierarchical
        a = torch.distributed.get_world_size(a2a_group)
        _check_heads(config, a, "hierarchical_context_parallel_sizes")
        return functools.partial(_hierarchical, cp_size=n, a2a_group=a2a_group, ring_group=ring_group)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        if attention_mask is not None and not isinstance(attention_mask, DocumentMask):
            raise ValueError(
                "context-parallel attention takes attention_mask None (causal) or a DocumentMask of "
                "the full sequence, not a dense mask tensor (the data loader's mask is not used with "
                "context parallelism)"
            )
        s_l, b, n_q, d = q.shape
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(d)
        out = self._attend(q, k, v, attention_mask, scale)
        return out.reshape(s_l, b, n_q * d)


def _check_heads(config: Any, n: int, what: str) -> None:
    """ConfigError unless the rank's query heads and query groups split into ``n`` head blocks."""
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    n_q, n_kv = (
        config.num_attention_heads // tp,
        (config.num_query_groups or config.num_attention_heads) // tp,
    )
    if n_q % n or n_kv % n:
        raise ConfigError(
            f"all-to-all context parallelism splits heads over {n} ranks ({what}): the local "
            f"num_attention_heads {n_q} and num_query_groups {n_kv} (per tensor-parallel rank) must be "
            f"divisible by {n}; use num_query_groups a multiple of {n * tp} or cp_comm_type p2p",
            params=("num_query_groups", "num_attention_heads", what, "cp_comm_type"),
        )


def _ring(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_mask: Any, scale: float, **kw: Any
) -> torch.Tensor:
    c = q.shape[0] // 2
    out = ring_attention(
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        chunk_len=c,
        doc_mask=doc_mask,
        scale=scale,
        **kw,
    )
    return out.permute(2, 0, 1, 3)


def _all_gather(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_mask: Any, scale: float, **kw: Any
) -> torch.Tensor:
    return all_gather_attention(q, k, v, doc_mask, scale, **kw)


def _ulysses(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_mask: Any, scale: float, **kw: Any
) -> torch.Tensor:
    return ulysses_attention(q, k, v, doc_mask, **kw)  # the local attention has the scale


def _hierarchical(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_mask: Any, scale: float, **kw: Any
) -> torch.Tensor:
    return hierarchical_attention(q, k, v, doc_mask, scale, **kw)
