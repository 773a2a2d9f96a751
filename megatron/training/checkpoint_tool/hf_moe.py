"""The mixture-of-experts Hugging Face families, as configs: our MoE fields <-> a ``config.json``.

- ``mixtral`` (``MixtralForCausalLM``): Mistral's attention; every layer's MLP is ``num_local_experts``
  SwiGLU experts of ``intermediate_size`` (``w1`` gate, ``w3`` up, ``w2`` down) behind the router
  ``block_sparse_moe.gate``. The chosen ``num_experts_per_tok`` experts are weighted by the softmax
  over all experts, renormalised over the chosen ones: the softmax over the chosen experts' logits,
  which is Megatron's default routing (top-k of the logits, then softmax; no
  ``--moe-router-pre-softmax``).
- ``qwen2_moe`` (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases: ``qkv_bias``); the layers
  that have experts (``decoder_sparse_step``, ``mlp_only_layers``; ours: ``--moe-layer-freq`` as a
  list) hold experts of ``moe_intermediate_size`` and one shared expert of
  ``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(shared_expert_gate(x))``
  (our ``--moe-shared-expert-gate``, ``shared_experts.gate_weight`` ``[1, h]``); the other layers are
  dense MLPs of ``intermediate_size``. ``norm_topk_prob`` false: the weights are the top-k of the
  softmax over all experts, not renormalised (``--moe-router-pre-softmax``); true: renormalised
  (the default routing).
- ``qwen3_moe`` (``Qwen3MoeForCausalLM``): Qwen3's attention (an RMSNorm on each query and key head
  before RoPE: our ``--qk-layernorm``; no biases); experts as Qwen2-MoE's without a shared expert.

Megatron counts ``--moe-layer-freq N`` from layer 0 (layer ``i`` has experts when ``i % N == 0``),
Hugging Face's ``decoder_sparse_step`` from layer ``N - 1``: only the per-layer pattern is converted.
A feature a family cannot express is a :class:`ToolError` naming it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from megatron.core.transformer.moe_config_fields import moe_layer_pattern as layer_spec_pattern
from megatron.training.checkpoint_tool.errors import ToolError

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# TransformerConfig fields of the experts and their routing, with the values of a model without them
# (recorded by imports beside ARCH_FIELDS; read back to build the model for the logits check).
MOE_DEFAULTS: dict[str, Any] = {
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_expert_capacity_factor": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_layer_freq": 1,
    "moe_aux_loss_coeff": 0.0,
    "moe_input_jitter_eps": None,
}
MOE_FIELDS = tuple(MOE_DEFAULTS)


def moe_layer_pattern(m: dict[str, Any]) -> list[int]:
    """1 for each layer with experts, 0 for a dense one, as the layer specs read ``moe_layer_freq``
    (``moe_config_fields.moe_layer_pattern``); all zeros for a model without experts.

    Raises:
        ToolError: a ``moe_layer_freq`` that is neither a positive int nor a list of one 0/1 per layer.
    """
    num_layers = m["num_layers"]
    freq = m.get("moe_layer_freq", 1)
    valid_int = isinstance(freq, int) and freq > 0
    valid_list = isinstance(freq, (list, tuple)) and len(freq) == num_layers and set(freq) <= {0, 1}
    if m.get("num_moe_experts") and not (valid_int or valid_list):
        raise ToolError(f"--moe-layer-freq {freq!r}: give an int or a list of {num_layers} zeros and ones")
    config = SimpleNamespace(
        num_layers=num_layers, num_moe_experts=m.get("num_moe_experts"), moe_layer_freq=freq
    )
    return [int(x) for x in layer_spec_pattern(config)]


def moe_ffn(m: dict[str, Any]) -> int:
    """The experts' hidden size: ``moe_ffn_hidden_size``, else ``ffn_hidden_size`` (Megatron's default)."""
    size = m.get("moe_ffn_hidden_size")
    return int(size if size is not None else m["ffn_hidden_size"])


def _aux_coeff(m: dict[str, Any]) -> float:
    coeff = m.get("moe_aux_loss_coeff") or 0.0
    return float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff)


def moe_problems(family: str, m: dict[str, Any]) -> list[tuple[Any, str]]:
    """(condition, the feature it names) for every feature of our fields ``m`` that the MoE ``family``
    cannot compute exactly; a true condition is a refusal."""
    pattern = moe_layer_pattern(m)
    shared = m.get("moe_shared_expert_intermediate_size")
    n_h, d, h = m["num_attention_heads"], m["kv_channels"], m["hidden_size"]
    scaling = m.get("moe_router_topk_scaling_factor")
    return [
        (not m.get("num_moe_experts"), "a model without experts (use --model-type llama, mistral or qwen2)"),
        (
            m.get("moe_router_score_function", "softmax") != "softmax",
            f"--moe-router-score-function {m.get('moe_router_score_function')} (the router is a softmax)",
        ),
        (m.get("moe_router_enable_expert_bias"), "--moe-router-enable-expert-bias"),
        (scaling not in (None, 1.0), f"--moe-router-topk-scaling-factor {scaling}"),
        (
            m.get("moe_router_num_groups") or m.get("moe_router_group_topk"),
            "group-limited routing (--moe-router-num-groups / --moe-router-group-topk)",
        ),
        (m.get("moe_expert_capacity_factor") is not None, "token dropping (--moe-expert-capacity-factor)"),
        (
            m.get("add_bias_linear"),
            "biases on the linear layers (its experts have none: --disable-bias-linear)",
        ),
        (
            family == "mixtral" and m.get("moe_router_pre_softmax"),
            "--moe-router-pre-softmax (Mixtral renormalises the chosen experts' weights)",
        ),
        (family == "mixtral" and 0 in pattern, f"dense layers (--moe-layer-freq {m.get('moe_layer_freq')})"),
        (
            family != "qwen2_moe" and bool(shared),
            "shared experts (--moe-shared-expert-intermediate-size: that is qwen2_moe)",
        ),
        (family == "qwen2_moe" and not shared, "a layer without a shared expert (use qwen3_moe or mixtral)"),
        (
            family == "qwen2_moe" and bool(shared) and not m.get("moe_shared_expert_gate"),
            "a shared expert without its gate (--moe-shared-expert-gate)",
        ),
        (family == "qwen3_moe" and not m.get("qk_layernorm"), "attention without --qk-layernorm"),
        (
            family != "qwen3_moe" and m.get("qk_layernorm"),
            "--qk-layernorm (query/key norms: that is qwen3_moe)",
        ),
        (family != "qwen2_moe" and m.get("add_qkv_bias"), "--add-qkv-bias (q/k/v biases: that is qwen2_moe)"),
        (family == "qwen2_moe" and n_h * d != h, f"--kv-channels {d} with {n_h} heads != --hidden-size {h}"),
        (
            m.get("rope_scaling") or m.get("rotary_seq_len_interpolation_factor"),
            "RoPE scaling (--use-rope-scaling / --rotary-seq-len-interpolation-factor)",
        ),
        (m.get("rotary_percent", 1.0) < 1.0, f"--rotary-percent {m.get('rotary_percent')}"),
        (
            m.get("softmax_scale") not in (None, 1 / math.sqrt(d)),
            f"a softmax scale {m.get('softmax_scale')} other than 1/sqrt(kv_channels)",
        ),
    ]


def moe_hf_config(family: str, m: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the MoE ``family``: the Llama-like ``base`` (attention, norms, RoPE) with the
    experts, their routing and the layer pattern of our fields ``m`` (``moe_problems`` passed)."""
    out = {**base, "output_router_logits": False, "router_aux_loss_coef": _aux_coeff(m)}
    experts, topk = m["num_moe_experts"], m["moe_router_topk"]
    if family == "mixtral":
        out.update(
            intermediate_size=moe_ffn(m),
            num_local_experts=experts,
            num_experts_per_tok=topk,
            router_jitter_noise=float(m.get("moe_input_jitter_eps") or 0.0),
            sliding_window=None,
        )
        return out
    pattern = moe_layer_pattern(m)
    out.update(
        moe_intermediate_size=moe_ffn(m),
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=not m.get("moe_router_pre_softmax"),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, has_experts in enumerate(pattern) if not has_experts],
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=m["num_layers"],
    )
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"])
        out["qkv_bias"] = bool(m["add_qkv_bias"])
    else:
        out["attention_bias"] = False
    return out


def moe_fields_from_hf(family: str, cfg: Any, dense: dict[str, Any]) -> dict[str, Any]:
    """Our fields of a MoE transformers config: the Llama-like ``dense`` fields (attention, norms,
    RoPE) with the experts, their routing and the layer pattern.

    Raises:
        ToolError: a setting the family's model has that ours does not compute.
    """
    num_layers = cfg.num_hidden_layers
    out = {**dense, "add_bias_linear": False, "qk_layernorm": family == "qwen3_moe"}
    out["add_qkv_bias"] = family == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True))
    out["moe_aux_loss_coeff"] = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    out["moe_router_topk"] = int(cfg.num_experts_per_tok)
    if family == "mixtral":
        jitter = float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0)
        out.update(
            num_moe_experts=int(cfg.num_local_experts),
            moe_ffn_hidden_size=cfg.intermediate_size,
            moe_input_jitter_eps=jitter or None,
        )
        return out
    if getattr(cfg, "use_sliding_window", False):
        raise ToolError("config.json use_sliding_window true: sliding-window attention is not built")
    if not cfg.num_experts:
        raise ToolError(f"config.json num_experts {cfg.num_experts}: a {family} model without experts")
    skipped = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    pattern = [int(i not in skipped and (i + 1) % step == 0) for i in range(num_layers)]
    out.update(
        num_moe_experts=int(cfg.num_experts),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_pre_softmax=not bool(getattr(cfg, "norm_topk_prob", False)),
        moe_layer_freq=1 if all(pattern) else pattern,
    )
    if family == "qwen2_moe":
        if not cfg.shared_expert_intermediate_size:
            raise ToolError(
                "config.json shared_expert_intermediate_size 0: a Qwen2-MoE shared expert of no size"
            )
        out.update(
            moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
        )
    return out


def moe_model_flags(m: dict[str, Any]) -> list[str]:
    """The pretrain_gpt.py flags of the experts in our fields ``m`` (none for a dense model)."""
    if not m.get("num_moe_experts"):
        return []
    flags = [
        f"--num-experts {m['num_moe_experts']}",
        f"--moe-ffn-hidden-size {moe_ffn(m)}",
        f"--moe-router-topk {m['moe_router_topk']}",
    ]
    if m.get("moe_router_pre_softmax"):
        flags.append("--moe-router-pre-softmax")
    freq = m.get("moe_layer_freq", 1)
    if freq != 1:
        flags.append(
            f"--moe-layer-freq {str(list(freq)).replace(' ', '') if isinstance(freq, list) else freq}"
        )
    if m.get("moe_shared_expert_intermediate_size"):
        flags.append(f"--moe-shared-expert-intermediate-size {m['moe_shared_expert_intermediate_size']}")
        if m.get("moe_shared_expert_gate"):
            flags.append("--moe-shared-expert-gate")
    if m.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    return flags


def aux_loss_note(m: dict[str, Any]) -> str | None:
    """The line telling a user the imported model's load-balancing coefficient (a training flag, which
    ``--use-checkpoint-args`` does not take)."""
    coeff = _aux_coeff(m)
    if not m.get("num_moe_experts") or not coeff:
        return None
    return (
        f"note: config.json router_aux_loss_coef {coeff}: pass --moe-aux-loss-coeff {coeff} to train with "
        "the model's load-balancing loss (a training flag: --use-checkpoint-args does not take it)"
    )
