"""Model FLOPs per step (Megatron's ``num_floating_point_operations``) and MFU.

Convention: every GEMM counts 2 FLOPs per multiply-accumulate and runs three times per step
(forward, input-gradient and weight-gradient), hence the factor 6. Causal attention counts half of
the QK^T and PV products. Activation recompute is not counted (these are model FLOPs, not hardware
FLOPs), so MFU = achieved model FLOP/s / the device's dense peak.

Attention is counted as full causal attention over the whole sequence whatever the mask, as Megatron
does: with --reset-attention-mask (packed documents, each attending only within itself) the logged
TFLOP/s and MFU keep this convention. :func:`document_masked_floating_point_operations` gives the
step's FLOPs with the attention the documents actually do (the sum over documents of L^2 instead of
S^2 per sequence, halved for causal in the same way), a separate figure for the log. Context
parallelism changes neither: it splits the same work over the cp ranks.

Mixture of experts counts the experts a token actually runs through: in an MoE layer the k routed
experts of F_moe and the shared experts F_sh (``moe_layer_freq``'s pattern says which layers),
whatever the expert-parallel layout; dropped tokens and capacity padding are not subtracted or
added (Megatron's convention), so MFU is on active parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron.core.transformer.moe_config_fields import moe_layer_pattern


@dataclass(frozen=True)
class FlopsShape:
    """The model quantities the formula needs (V is the padded vocabulary)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: int
    swiglu: bool
    num_moe_layers: int = 0
    """Layers whose MLP is routed experts (``moe_layer_freq``'s pattern); the others are dense."""
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    """Active routed experts per token (k) in an MoE layer."""
    shared_expert_size: int = 0
    """F_sh: the shared experts' hidden size (0: none), run on every token of an MoE layer."""


def shape_from_config(config, padded_vocab_size: int) -> FlopsShape:
    moe_layers = sum(moe_layer_pattern(config))
    return FlopsShape(
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_query_groups,
        config.kv_channels,
        config.ffn_hidden_size,
        padded_vocab_size,
        config.activation == "swiglu",
        num_moe_layers=moe_layers,
        moe_ffn_hidden_size=(config.moe_ffn_hidden_size or 0) if moe_layers else 0,
        moe_router_topk=config.moe_router_topk if moe_layers else 0,
        shared_expert_size=(config.moe_shared_expert_intermediate_size or 0) if moe_layers else 0,
    )


def mlp_flops_per_token(shape: FlopsShape) -> int:
    """The MLPs' 6 x MACs per token: dense layers F, MoE layers k routed experts of F_moe plus the
    shared experts F_sh (the router's [h, E] GEMM is not counted, as in Megatron)."""
    e = 3 if shape.swiglu else 2
    dense = shape.num_layers - shape.num_moe_layers
    routed = shape.moe_ffn_hidden_size * shape.moe_router_topk + shape.shared_expert_size
    return 6 * shape.hidden_size * e * (shape.ffn_hidden_size * dense + routed * shape.num_moe_layers)


def core_attention_flops(shape: FlopsShape, sum_squared_lengths: int) -> int:
    """Causal core attention (QK^T and PV) of sequences whose squared lengths sum to
    ``sum_squared_lengths``: half of 12 * s^2 * q_p per layer and sequence."""
    q_proj = shape.kv_channels * shape.num_attention_heads
    return sum_squared_lengths * 6 * q_proj * shape.num_layers


def num_floating_point_operations(shape: FlopsShape, batch_size: int, seq_length: int) -> int:
    """Model FLOPs of one step over ``batch_size`` samples of ``seq_length`` tokens."""
    h, L, d = shape.hidden_size, shape.num_layers, shape.kv_channels
    q_proj = d * shape.num_attention_heads
    tokens = batch_size * seq_length
    per_token = (
        mlp_flops_per_token(shape)  # MLP: dense, routed (k active experts) and shared experts
        + 6 * (h * (q_proj + 2 * d * shape.num_query_groups) + q_proj * h) * L  # QKV + output projection
        + 6 * h * shape.padded_vocab_size  # logit layer
    )
    return tokens * per_token + core_attention_flops(shape, batch_size * seq_length**2)


def document_masked_floating_point_operations(
    shape: FlopsShape, batch_size: int, seq_length: int, document_lengths: Iterable[int]
) -> int:
    """Model FLOPs of one step whose attention is masked to documents: ``document_lengths`` are the
    lengths of every document of every sample of the step (together ``batch_size * seq_length``
    tokens); attention counts the sum of their squares instead of ``batch_size * seq_length^2``.

    Raises:
        ValueError: the lengths do not add up to the step's tokens.
    """
    lengths = [int(n) for n in document_lengths]
    if sum(lengths) != batch_size * seq_length:
        raise ValueError(
            f"document lengths add up to {sum(lengths)} tokens, not the step's {batch_size} x {seq_length}"
        )
    full = num_floating_point_operations(shape, batch_size, seq_length)
    return (
        full
        - core_attention_flops(shape, batch_size * seq_length**2)
        + core_attention_flops(shape, sum(n * n for n in lengths))
    )


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """The lengths of the documents of ``doc_ids`` ``[b, S]`` (a DocumentMask's, non-decreasing along
    each row), row by row in order."""
    lengths: list[int] = []
    for row in doc_ids.cpu():
        lengths += torch.unique_consecutive(row, return_counts=True)[1].tolist()
    return lengths


# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, matched against the device name.
# Order matters: more specific names first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("V100", 125.0),
)


def peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak of a known GPU, or None (CPU, unknown device): MFU is then not reported."""
    if not device_name:
        return None
    for key, peak in PEAK_BF16_TFLOPS:
        if key in device_name:
            return peak
    return None
