"""The Hugging Face model families ``convert`` writes and reads, as configs: our model fields <-> a
``config.json``.

Our side is the checkpoint's ``args['config']['model']`` (``TransformerConfig`` field names, the
subset in :data:`ARCH_FIELDS` that fixes the function the model computes). The families:

- ``llama`` (``LlamaForCausalLM``), ``mistral`` (``MistralForCausalLM``, the same weights): RMSNorm,
  SwiGLU, RoPE, grouped-query attention; Llama's ``attention_bias`` / ``mlp_bias`` are our
  ``add_bias_linear``.
- ``qwen2`` (``Qwen2ForCausalLM``): Llama with biases on q, k and v only (our ``add_qkv_bias``).
- ``gpt2`` (``GPT2LMHeadModel``): LayerNorm, GELU (``gelu_new`` = Megatron's tanh approximation,
  ``gelu`` = the exact erf GELU), biases everywhere, a learned position table, one head per group.
- ``mixtral``, ``qwen2_moe``, ``qwen3_moe``: mixtures of experts (:mod:`.hf_moe`).

A feature a family cannot express is a :class:`ToolError` naming it, never a silent approximation.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.training.checkpoint_args import ARCHITECTURE
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.hf_moe import (
    MOE_ARCHITECTURES,
    MOE_DEFAULTS,
    MOE_FAMILIES,
    MOE_FIELDS,
    moe_fields_from_hf,
    moe_hf_config,
    moe_problems,
)

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", *MOE_FAMILIES)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    **MOE_ARCHITECTURES,
}

# TransformerConfig fields that fix the function the model computes (recorded by imports in
# args['config']['model']; read back to build the model for the logits check): the architecture
# fields and the experts' (MOE_FIELDS).
ARCH_FIELDS = (*ARCHITECTURE["model"], *(f for f in MOE_FIELDS if f not in ARCHITECTURE["model"]))

# The Llama 3 scaling our RoPE implements (megatron.core.transformer.rope): only the factor varies.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gelu_is_tanh(m: dict[str, Any]) -> bool:
    """Whether a GELU model computes Megatron's tanh approximation (``TransformerConfig.gelu_approximation``)."""
    fused = bool(m.get("bias_gelu_fusion")) or bool(m.get("bias_activation_fusion"))
    return m.get("activation") == "gelu" and bool(m.get("add_bias_linear")) and fused


def detect_family(m: dict[str, Any]) -> str:
    """The family our model fields ``m`` belong to (``--model-type`` overrides it).

    Raises:
        ToolError: a combination no family has (named).
    """
    pos, norm, act = m.get("position_embedding_type"), m.get("normalization"), m.get("activation")
    if pos == "learned_absolute" and norm == "LayerNorm" and act == "gelu":
        return "gpt2"
    if pos == "rope" and norm == "RMSNorm" and act == "swiglu":
        qkv_bias = m.get("add_qkv_bias") and not m.get("add_bias_linear")
        if m.get("num_moe_experts"):
            if m.get("qk_layernorm"):
                return "qwen3_moe"
            return "qwen2_moe" if qkv_bias or m.get("moe_shared_expert_intermediate_size") else "mixtral"
        return "qwen2" if qkv_bias else "llama"
    raise ToolError(
        f"no Hugging Face family here for --position-embedding-type {pos} with --normalization {norm} "
        f"and activation {act}: Llama / Mistral / Qwen2 are rope + RMSNorm + --swiglu, GPT-2 is "
        "learned_absolute + LayerNorm + GELU"
    )


def check_expressible(family: str, m: dict[str, Any]) -> None:
    """Refuse, in one line naming the feature, a model that ``family`` cannot compute exactly.

    Raises:
        ToolError: the first feature that does not fit.
    """
    gpt2 = family == "gpt2"
    needs = {
        "position_embedding_type": "learned_absolute" if gpt2 else "rope",
        "normalization": "LayerNorm" if gpt2 else "RMSNorm",
        "activation": "gelu" if gpt2 else "swiglu",
    }
    for field, want in needs.items():
        if m.get(field) != want:
            raise ToolError(f"--model-type {family} needs {field} {want}; the checkpoint has {m.get(field)}")
    problems = moe_problems(family, m) if family in MOE_FAMILIES else _dense_problems(family, m)
    for bad, what in problems:
        if bad:
            raise ToolError(f"--model-type {family} cannot express {what}")


def _dense_problems(family: str, m: dict[str, Any]) -> list[tuple[Any, str]]:
    """``check_expressible``'s refusals for the dense families: (condition, the feature it names)."""
    n_h, n_g, d, h = (m["num_attention_heads"], m["num_query_groups"], m["kv_channels"], m["hidden_size"])
    gpt2 = family == "gpt2"
    return [
        (m.get("qk_layernorm"), "--qk-layernorm (query/key norms)"),
        (
            m.get("num_moe_experts"),
            "MoE layers (--num-experts: use --model-type mixtral, qwen2_moe or qwen3_moe)",
        ),
        (not gpt2 and m.get("rotary_percent", 1.0) < 1.0, f"--rotary-percent {m.get('rotary_percent')}"),
        (
            m.get("softmax_scale") not in (None, 1 / math.sqrt(d)),
            f"a softmax scale {m.get('softmax_scale')} other than 1/sqrt(kv_channels)",
        ),
        (gpt2 and not m.get("add_bias_linear"), "--disable-bias-linear (GPT-2 has biases)"),
        (gpt2 and n_g != n_h, "grouped-query attention (GPT-2 has one key/value head per head)"),
        (gpt2 and n_h * d != h, f"--kv-channels {d} with {n_h} heads != --hidden-size {h}"),
        (family == "qwen2" and m.get("add_bias_linear"), "biases beyond q/k/v (Qwen2: --add-qkv-bias only)"),
        (family == "qwen2" and n_h * d != h, f"--kv-channels {d} with {n_h} heads != --hidden-size {h}"),
        (family == "mistral" and m.get("add_bias_linear"), "biases (Mistral has none)"),
        (
            family in ("llama", "mistral") and m.get("add_qkv_bias") and not m.get("add_bias_linear"),
            "--add-qkv-bias without the other biases (that is Qwen2: --model-type qwen2)",
        ),
        (
            family == "mistral" and (m.get("rope_scaling") or m.get("rotary_seq_len_interpolation_factor")),
            "RoPE scaling (use --model-type llama)",
        ),
        (
            m.get("rope_scaling") and m.get("rotary_seq_len_interpolation_factor"),
            "--use-rope-scaling together with --rotary-seq-len-interpolation-factor",
        ),
    ]


def _rope_scaling_to_hf(m: dict[str, Any]) -> dict[str, Any] | None:
    if m.get("rope_scaling"):
        return {"rope_type": "llama3", "factor": float(m["rope_scaling_factor"]), **LLAMA3_FIXED}
    if m.get("rotary_seq_len_interpolation_factor"):
        return {"rope_type": "linear", "factor": float(m["rotary_seq_len_interpolation_factor"])}
    return None


def hf_config(
    family: str,
    m: dict[str, Any],
    vocab_size: int,
    max_position_embeddings: int,
    dtype: str,
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> dict[str, Any]:
    """``config.json`` of ``family`` for our model fields ``m`` (``check_expressible`` passed).

    Written in the keys transformers 4.45 reads (``rope_theta``, ``rope_scaling``, ``torch_dtype``),
    which later versions read too.
    """
    common = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "tie_word_embeddings": bool(m["share_embeddings_and_output_weights"]),
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "gpt2":
        return {
            **common,
            "n_embd": m["hidden_size"],
            "n_layer": m["num_layers"],
            "n_head": m["num_attention_heads"],
            "n_inner": m["ffn_hidden_size"],
            "n_positions": max_position_embeddings,
            "activation_function": "gelu_new" if gelu_is_tanh(m) else "gelu",
            "layer_norm_epsilon": m["layernorm_epsilon"],
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    out = {
        **common,
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"],
        "head_dim": m["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": m["layernorm_epsilon"],
        "rope_theta": float(m["rotary_base"]),
        "rope_scaling": _rope_scaling_to_hf(m),
        "attention_dropout": 0.0,
    }
    if family == "llama":
        out.update(attention_bias=bool(m["add_bias_linear"]), mlp_bias=bool(m["add_bias_linear"]))
        out["pretraining_tp"] = 1
    elif family == "mistral":
        out["sliding_window"] = None
    elif family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m["num_layers"])
    else:
        out = moe_hf_config(family, m, out)
    return out


# ---------------------------------------------------------------------------------------------------
# Hugging Face -> ours


def _rope_from_hf(cfg: Any) -> tuple[float, dict[str, Any]]:
    """(rope theta, the scaling dict or {}) of a transformers config, in 4.x's or 5.x's keys."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    if params.get("rope_type", params.get("type", "default")) == "default":
        params = {}
    return float(theta), params


def _rope_fields(cfg: Any) -> dict[str, Any]:
    theta, scaling = _rope_from_hf(cfg)
    base = int(theta) if float(theta).is_integer() else theta
    out: dict[str, Any] = {
        "rotary_base": base,
        "rope_scaling": False,
        "rotary_seq_len_interpolation_factor": None,
    }
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        for name, want in LLAMA3_FIXED.items():
            if float(scaling.get(name, want)) != float(want):
                raise ToolError(f"rope_scaling llama3 with {name} {scaling.get(name)}: only {want} is built")
        out.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    elif kind == "linear":
        out["rotary_seq_len_interpolation_factor"] = float(scaling["factor"])
    elif kind is not None:
        raise ToolError(f"config.json rope_scaling type {kind!r} is not built here (llama3 and linear are)")
    return out


def _llama_like_fields(family: str, cfg: Any) -> dict[str, Any]:
    n_h = cfg.num_attention_heads
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ToolError(
            f"config.json hidden_act {cfg.hidden_act!r}: only silu (SwiGLU) is built for {family}"
        )
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    if attention_bias != bool(getattr(cfg, "mlp_bias", False)):
        raise ToolError("config.json attention_bias != mlp_bias: our biases are all on or all off")
    if family == "qwen2" and getattr(cfg, "use_sliding_window", False):
        raise ToolError("config.json use_sliding_window true: sliding-window attention is not built")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_h
    return {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": n_h,
        "num_query_groups": getattr(cfg, "num_key_value_heads", None) or n_h,
        "kv_channels": head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg.rms_norm_eps,
        "activation": "swiglu",
        "add_bias_linear": attention_bias,
        "add_qkv_bias": family == "qwen2" or attention_bias,
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        **_rope_fields(cfg),
    }


def _gpt2_fields(cfg: Any) -> dict[str, Any]:
    act = cfg.activation_function
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ToolError(f"config.json activation_function {act!r}: gelu_new or gelu is built for GPT-2")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or not getattr(cfg, "scale_attn_weights", True):
        raise ToolError("config.json scale_attn_by_inverse_layer_idx / scale_attn_weights: not built here")
    return {
        "num_layers": cfg.n_layer,
        "hidden_size": cfg.n_embd,
        "ffn_hidden_size": cfg.n_inner or 4 * cfg.n_embd,
        "num_attention_heads": cfg.n_head,
        "num_query_groups": cfg.n_head,
        "kv_channels": cfg.n_embd // cfg.n_head,
        "normalization": "LayerNorm",
        "layernorm_epsilon": cfg.layer_norm_epsilon,
        "activation": "gelu",
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "bias_gelu_fusion": act != "gelu",
        "position_embedding_type": "learned_absolute",
    }


def fields_from_hf(cfg: Any) -> tuple[str, dict[str, Any], int]:
    """(family, our model fields, max_position_embeddings) of a transformers config object.

    Raises:
        ToolError: a model type or a setting that is not built here.
    """
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        raise ToolError(
            f"config.json model_type {family!r} is not converted; use one of {', '.join(FAMILIES)}"
        )
    if family == "gpt2":
        fields, max_pos = _gpt2_fields(cfg), cfg.n_positions
    elif family in MOE_FAMILIES:
        if family == "qwen3_moe" and getattr(cfg, "attention_bias", False):
            raise ToolError(
                "config.json attention_bias true: q/k/v/o biases without MLP biases are not built"
            )
        dense = _llama_like_fields(family, cfg)
        fields, max_pos = moe_fields_from_hf(family, cfg, dense), cfg.max_position_embeddings
    else:
        fields, max_pos = _llama_like_fields(family, cfg), cfg.max_position_embeddings
    tied = getattr(cfg, "tie_word_embeddings", family == "gpt2")
    defaults = {
        "bias_gelu_fusion": True,
        "bias_activation_fusion": False,
        "rotary_base": 10000,
        "rotary_percent": 1.0,
        "rope_scaling": False,
        "rope_scaling_factor": 8.0,
        "rotary_seq_len_interpolation_factor": None,
        "qk_layernorm": False,
        "apply_layernorm_1p": False,
        "softmax_scale": None,
        "num_moe_experts": None,
        **MOE_DEFAULTS,
    }
    out = {**defaults, **fields, "share_embeddings_and_output_weights": bool(tied)}
    return family, {k: out[k] for k in ARCH_FIELDS}, int(max_pos)
