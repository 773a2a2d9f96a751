"""Megatron-Core's ``apply_rotary_pos_emb``: rotate the first channels of each head by RoPE angles.

One implementation with the model's rotary embedding (:func:`megatron.core.transformer.rope.apply_rotary`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.models.common.embeddings.rotary_pos_embedding import _refuse_cp
from megatron.core.transformer.rope import apply_rotary


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
    mla_rotary_interleaved: bool = False,
) -> torch.Tensor:
    """``t`` ``[s, b, n, d]`` with its first ``freqs.shape[-1]`` channels rotated by the angles ``freqs``
    ``[s, 1 or b, 1, rd]`` (``RotaryEmbedding``'s output), the rest passed through; cos / sin are
    scaled by ``mscale`` and cast to ``t``'s dtype.

    Raises:
        ConfigError: packed sequences (``cu_seqlens``), a context-parallel group of more than one rank,
            interleaved RoPE (``config.rotary_interleaved`` or ``mla_rotary_interleaved``).
    """
    if cu_seqlens is not None:
        raise ConfigError(
            "apply_rotary_pos_emb(cu_seqlens=...) is not supported here: packed (thd) sequences are "
            "not built; pass [s, b, n, d] tensors and cu_seqlens=None"
        )
    _refuse_cp(cp_group, "apply_rotary_pos_emb")
    if getattr(config, "rotary_interleaved", False) or mla_rotary_interleaved:
        raise ConfigError(
            "apply_rotary_pos_emb with interleaved RoPE is not supported here: RoPE rotates halves; "
            "set rotary_interleaved=False"
        )
    return apply_rotary(t, freqs.cos() * mscale, freqs.sin() * mscale)
