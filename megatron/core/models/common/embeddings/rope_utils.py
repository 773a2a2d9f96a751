"""Megatron-Core's ``apply_rotary_pos_emb``: rotate the first channels of each head by RoPE angles.

One implementation with the model's rotary embedding (:func:`megatron.core.transformer.rope.apply_rotary`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.config_utils import ConfigError
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

    ``cp_group`` is accepted and, as in Megatron-Core's ``[s, b, n, d]`` path, not used: ``freqs`` are
    already this cp rank's rows (``RotaryEmbedding.forward`` with the cp group); only Megatron-Core's
    packed (thd) path reads it, and packed ``cu_seqlens`` are refused here.

    Raises:
        ConfigError: packed sequences (``cu_seqlens``), interleaved RoPE (``config.rotary_interleaved``
            or ``mla_rotary_interleaved``).
    """
    if cu_seqlens is not None:
        raise ConfigError(
            "apply_rotary_pos_emb(cu_seqlens=...) is not supported here: packed (thd) sequences are "
            "not built; pass [s, b, n, d] tensors and cu_seqlens=None"
        )
    if getattr(config, "rotary_interleaved", False) or mla_rotary_interleaved:
        raise ConfigError(
            "apply_rotary_pos_emb with interleaved RoPE is not supported here: RoPE rotates halves; "
            "set rotary_interleaved=False"
        )
    return apply_rotary(t, freqs.cos() * mscale, freqs.sin() * mscale)
