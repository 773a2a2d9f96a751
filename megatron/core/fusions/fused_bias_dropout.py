"""Megatron-Core's bias-dropout-add functions, for specs that name them (``self_attn_bda`` /
``mlp_bda``). Our TransformerLayer applies its own bias-dropout-add whatever the spec names; these
compute the same function for code that calls them directly."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.core.transformer.transformer_layer import bias_dropout_add

XWithBias = tuple[torch.Tensor, torch.Tensor | None]
BiasDropoutAdd = Callable[[XWithBias, torch.Tensor, float], torch.Tensor]


def bias_dropout_add_unfused(training: bool) -> BiasDropoutAdd:
    """``f((x, bias), residual, prob) = residual + dropout(x + bias, prob)`` (dropout only when training)."""

    def _bda(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        return bias_dropout_add(x, bias, residual, prob, training)

    return _bda


def bias_dropout_add_fused_train(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    return bias_dropout_add_unfused(True)(x_with_bias, residual, prob)


def bias_dropout_add_fused_inference(
    x_with_bias: XWithBias, residual: torch.Tensor, prob: float
) -> torch.Tensor:
    return bias_dropout_add_unfused(False)(x_with_bias, residual, prob)


def get_bias_dropout_add(training: bool, fused: bool) -> BiasDropoutAdd:
    """Megatron-Core's selector; ``fused`` picks the same function here (no separate fused kernel)."""
    if fused:
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)


__all__ = [
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_unfused",
    "get_bias_dropout_add",
]
