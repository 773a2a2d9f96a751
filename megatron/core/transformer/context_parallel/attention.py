"""Context-parallel core attention: the core-attention slot's module when the sequence is split over
cp ranks (see ``layout``). GROUNDWORK INTERFACE: the algorithms are being built (issue 28)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.core.transformer.context_parallel.layout import ContextParallelGroups, comm_type_of_layer
from megatron.core.transformer.enums import AttnMaskType


class ContextParallelAttention(nn.Module):
    """Causal attention of this cp rank's queries over the whole sequence's keys and values.

    Inputs are this rank's tokens (its two chunks, ``layout.local_token_indices`` order): ``q``
    ``[s_local, b, n_q, d]``, ``k`` / ``v`` ``[s_local, b, n_kv, d]``; output ``[s_local, b, n_q * d]``.
    ``attention_mask`` is None (causal over the global sequence) or a
    :class:`~megatron.core.transformer.document_mask.DocumentMask` of the full sequence.
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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        raise NotImplementedError("context-parallel attention is being built (issue 28)")
