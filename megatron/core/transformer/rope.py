"""Rotary position embeddings (RoPE), non-interleaved ("rotate half") as in Megatron-Core."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(
    rotary_dim: int, base: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[rotary_dim / 2]`` fp32: channel pair ``i`` turns by ``base ** (-2i / rotary_dim)`` per position."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def llama3_scaled_inverse_frequencies(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama 3.x's RoPE frequency scaling (Megatron's ``--use-rope-scaling``, Hugging Face's
    ``rope_type: llama3``): wavelengths longer than ``original / low_freq_factor`` are divided by
    ``factor``, shorter than ``original / high_freq_factor`` kept, and the band between interpolated
    smoothly."""
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_max_position_embeddings / low_freq_factor
    short_wave = wavelen < original_max_position_embeddings / high_freq_factor
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~short_wave & ~long_wave, smoothed, scaled)


def rotary_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, seq_len_interpolation_factor: float | None = None
) -> torch.Tensor:
    """The rotation angles (Megatron-Core's ``freqs``) ``[*positions.shape, rotary_dim]`` in fp32 for
    positions of any shape: ``p * inv_freq``, repeated for the two halves that rotate together.
    With ``seq_len_interpolation_factor`` f (linear position interpolation) ``p`` becomes
    ``p * (1 / f)``, computed in fp32 as Megatron-Core does."""
    positions = positions.float()
    if seq_len_interpolation_factor is not None:
        positions = positions * (1.0 / seq_len_interpolation_factor)
    freqs = positions.unsqueeze(-1) * inv_freq
    return torch.cat((freqs, freqs), dim=-1)


def rotary_cos_sin(
    position_ids: torch.Tensor,
    rotary_dim: int,
    base: float,
    seq_len_interpolation_factor: float | None = None,
    rope_scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``position_ids`` ``[b, s]``, each ``[s, b, 1, rotary_dim]`` in fp32
    (:func:`rotary_angles` of the positions). ``rope_scaling_factor``: Llama 3.x's frequency scaling
    with that factor (:func:`llama3_scaled_inverse_frequencies`); None: none."""
    inv_freq = inverse_frequencies(rotary_dim, base, position_ids.device)
    if rope_scaling_factor is not None:
        inv_freq = llama3_scaled_inverse_frequencies(inv_freq, factor=rope_scaling_factor)
    emb = rotary_angles(position_ids.t(), inv_freq, seq_len_interpolation_factor).unsqueeze(
        2
    )  # [s, b, 1, rd]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[s, b, n, d]``; the rest pass through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
