"""Megatron-Core's spellings of ``TransformerConfig`` settings, kept in step with this package's.

``TransformerConfig.__post_init__`` calls these before the defaults are derived: a setting that both
spell (``fp8_format`` / ``fp8``, ``activation`` / ``gated_linear_unit`` + ``activation_func``, ...) reads
the same value under either name afterwards, and two names given different values raise ``ConfigError``
naming both.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from megatron.core.config_utils import ConfigError
from megatron.core.transformer import config_support

# What selective recompute (recompute_modules) can recompute here.
RECOMPUTE_MODULES = ("core_attn", "moe")


def sync_activation(config: Any) -> bool:
    """Make ``activation`` and Megatron-Core's ``gated_linear_unit`` / ``activation_func`` agree.
    True when SwiGLU was asked for by ``activation="swiglu"`` (``--swiglu``) alone, whose default
    ffn_hidden_size is Megatron-LM's int(8h/3 / 64) * 64 (Megatron-Core's fields default to 4h)."""
    if config.activation == "swiglu" and not config.gated_linear_unit and config.activation_func is F.gelu:
        config.gated_linear_unit, config.activation_func = True, F.silu
        return True
    name = config_support.activation_name(config.gated_linear_unit, config.activation_func)
    if config.activation == "swiglu" and name != "swiglu":
        raise ConfigError(
            f"activation='swiglu' contradicts gated_linear_unit={config.gated_linear_unit} with "
            "activation_func=F.gelu; give gated_linear_unit=True, activation_func=F.silu",
            params=("activation", "gated_linear_unit", "activation_func"),
        )
    config.activation = name
    return False


def sync_megatron_names(config: Any) -> None:
    """Megatron-Core's names of settings this package spells differently read the same value."""
    for ours, theirs in (
        ("fp8_format", "fp8"),
        ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
        ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage"),
        ("microbatch_group_size_per_virtual_pipeline_stage", "microbatch_group_size_per_vp_stage"),
    ):
        a, b = getattr(config, ours), getattr(config, theirs)
        if a is not None and b is not None and a != b:
            raise ConfigError(
                f"TransformerConfig.{ours}={a!r} contradicts {theirs}={b!r} (the same setting); "
                "give one of them",
                params=(ours, theirs),
            )
        value = a if a is not None else b
        setattr(config, ours, value)
        setattr(config, theirs, value)
    if config.apply_query_key_layer_scaling:
        config.attention_softmax_in_fp32 = True
    if config.transformer_impl not in ("local", "transformer_engine"):
        raise ConfigError(
            f"TransformerConfig.transformer_impl={config.transformer_impl!r} is not supported here; "
            "use 'local' (or 'transformer_engine', which builds the same local layers)",
            params=("transformer_impl",),
        )
    if config.recompute_modules is None:
        config.recompute_modules = ["core_attn"]
    if config.recompute_granularity == "selective":
        unknown = [m for m in config.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown or not config.recompute_modules:
            raise ConfigError(
                f"TransformerConfig.recompute_modules={config.recompute_modules!r} is not supported "
                f"here: selective recompute covers {' and '.join(RECOMPUTE_MODULES)} (the core attention, "
                "whole MoE layers); use e.g. ['core_attn'] or ['core_attn', 'moe']",
                params=("recompute_modules",),
            )
        if "moe" in config.recompute_modules and not config.num_moe_experts:
            raise ConfigError(
                "recompute_modules 'moe' recomputes MoE layers, and this model has none (num_moe_experts "
                "is unset); drop 'moe' or set num_moe_experts",
                params=("recompute_modules", "num_moe_experts"),
            )
        if config.recompute_num_layers is not None:
            raise ConfigError(
                "recompute_num_layers must be None with recompute_granularity='selective' "
                f"(got {config.recompute_num_layers}); it applies to 'full' recompute",
                params=("recompute_num_layers", "recompute_granularity"),
            )
