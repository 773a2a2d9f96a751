"""Megatron-Core's transformer enums: layer, attention and mask types and attention backends.

The attention layers here take a boolean mask or ``None`` (causal); ``AttnMaskType`` values are
accepted where Megatron-Core's users pass them and mean the same thing (``causal``: no mask needed).
"""

from __future__ import annotations

import enum

from megatron.core.enums import ModelType

__all__ = [
    "ModelType",
    "LayerType",
    "AttnType",
    "AttnMaskType",
    "AttnBackend",
    "CudaGraphModule",
    "CudaGraphScope",
]


class LayerType(enum.Enum):
    """The kind of a pipeline-layout entry: embedding, loss, encoder, decoder or MTP layer."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self- or cross-attention (only self-attention is built here)."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How attention is masked: ``causal`` (the decoder default), ``padding`` / ``arbitrary`` (the
    mask passed to forward), ``no_mask`` (bidirectional), ``padding_causal``, ``causal_bottom_right``."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    """Megatron-Core's attention kernel choice. Every value runs
    ``torch.nn.functional.scaled_dot_product_attention`` here, which picks its own kernel."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class CudaGraphModule(enum.Enum):
    """Regions Megatron-Core can capture in per-layer CUDA graphs (not used here)."""

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    """The older names of CUDA-graph capture regions, kept for configs that still use them."""

    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8
