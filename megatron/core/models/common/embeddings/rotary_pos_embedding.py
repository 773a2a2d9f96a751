"""Megatron-Core's ``RotaryEmbedding``: the rotation angles of RoPE for a sequence, ``[s, 1, 1, d]``.

The angles are :mod:`megatron.core.transformer.rope`'s (the ones GPTModel applies), so
``apply_rotary_pos_emb(t, RotaryEmbedding(...)(s), config)`` equals the model's rotary embedding.
With a context-parallel group of ``N > 1`` ranks, ``forward(S)`` returns the angles of this cp rank's
``S / N`` positions (its two zigzag chunks, ``context_parallel.layout``), the rows that rotate the
rank's slice of ``q`` and ``k`` (Megatron-Core's ``get_pos_emb_on_this_cp_rank``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.core.transformer.context_parallel.layout import slice_for_cp
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
        cp_group: the context-parallel group whose rank's positions ``forward`` returns (None: the
            recorded parallel state's cp group, if any; a group of one rank returns every position).

    Raises:
        ConfigError: ``rotary_interleaved``.
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
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp_group
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
        """Fp32 rotation angles (Megatron-Core's ``rotary_pos_emb``): ``[max_seq_len, 1, 1, dim]`` for
        positions ``offset ..`` of the whole sequence, or, with a cp group of ``N > 1`` ranks
        (``cp_group``, else the constructor's) and ``packed_seq`` False, ``[max_seq_len / N, 1, 1, dim]``
        for this cp rank's positions. ``packed_seq`` True returns every position (packed sequences
        pick their rows per document).

        Raises:
            ConfigError: ``max_seq_len`` does not split into ``2N`` equal chunks.
        """
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if group is None or packed_seq or group_size(group) == 1:
            return emb
        return slice_for_cp(emb, 0, group_size(group), group_rank(group))
