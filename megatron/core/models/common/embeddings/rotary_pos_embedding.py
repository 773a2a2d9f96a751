"""Megatron-Core's ``RotaryEmbedding``: the rotation angles of RoPE for a sequence, ``[s, 1, 1, d]``.

The angles are :mod:`megatron.core.transformer.rope`'s (the ones GPTModel applies), so
``apply_rotary_pos_emb(t, RotaryEmbedding(...)(s), config)`` equals the model's rotary embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import group_size
from megatron.core.transformer.rope import (
    inverse_frequencies,
    llama3_scaled_inverse_frequencies,
    rotary_angles,
)


class RotaryEmbedding(nn.Module):
    """RoPE angles for ``kv_channels * rotary_percent`` rotated channels per head.

    Args:
        kv_channels: channels per attention head.
        rotary_percent: the fraction of them that rotate.
        rotary_interleaved: must be False (the halves rotate together, Megatron-Core's default).
        seq_len_interpolation_factor: linear position interpolation (positions scaled by 1 / it).
        rotary_base: RoPE's base (theta).
        rope_scaling, rope_scaling_factor: Llama 3.x frequency scaling.
        use_cpu_initialization: accepted; the frequencies are a (non-persistent) buffer that moves
            with the module.
        cp_group: a context-parallel group of more than one rank is refused (not built yet).

    Raises:
        ConfigError: ``rotary_interleaved`` or a context-parallel group of size > 1.
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: Any = None,
    ) -> None:
        super().__init__()
        if rotary_interleaved:
            raise ConfigError(
                "RotaryEmbedding(rotary_interleaved=True) is not supported here: RoPE rotates halves "
                "(the non-interleaved layout); pass rotary_interleaved=False"
            )
        _refuse_cp(cp_group, "RotaryEmbedding")
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = inverse_frequencies(dim, rotary_base)
        if rope_scaling:
            inv_freq = llama3_scaled_inverse_frequencies(inv_freq, factor=rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """``[max_seq_len, dim / 2]``: position ``offset + i`` times each inverse frequency."""
        return self.get_emb(max_seq_len, offset)[:, 0, 0, : self.inv_freq.numel()]

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """``[max_seq_len, 1, 1, dim]`` fp32 angles of positions ``offset .. offset + max_seq_len - 1``."""
        positions = torch.arange(max_seq_len, device=self.inv_freq.device) + offset
        return rotary_angles(positions, self.inv_freq, self.seq_len_interpolation_factor)[:, None, None, :]

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        """``[max_seq_len, 1, 1, dim]`` fp32 rotation angles (Megatron-Core's ``rotary_pos_emb``)."""
        _refuse_cp(cp_group, "RotaryEmbedding.forward")
        return self.get_emb(max_seq_len, offset)


def _refuse_cp(cp_group: Any, where: str) -> None:
    if cp_group is not None and group_size(cp_group) > 1:
        raise ConfigError(
            f"{where}(cp_group=<{group_size(cp_group)} ranks>) is not supported here: context "
            "parallelism is not built yet (issue 29); pass no cp_group"
        )
