"""The derived shapes and split rules of a ``TransformerConfig`` (FP8, tensor- and pipeline-parallel,
recompute and mixture-of-experts fields), checked on construction.

Kept beside the config so that ``transformer_config`` holds the fields and their documentation;
each check raises ``ConfigError`` naming the fields (``params``) and a value that would be valid.
"""

from __future__ import annotations

from typing import Any

from megatron.core.config_utils import ConfigError, check_choice, check_positive
from megatron.core.fusions.fp8 import GEMM_IMPLS, torchao_error
from megatron.core.pipeline_parallel.layout import parse_layout
from megatron.core.transformer.moe_config_fields import DISPATCHERS, LOAD_BALANCING_TYPES, SCORE_FUNCTIONS


def check_fp8(config: Any) -> None:
    """The FP8 fields of a ``TransformerConfig`` (only with ``fp8_format``)."""
    if config.fp8_format is None:
        return
    check_choice("fp8_format", config.fp8_format, ("e4m3", "hybrid"))
    check_choice("fp8_recipe", config.fp8_recipe, ("tensorwise", "delayed"))
    check_choice("fp8_amax_compute_algo", config.fp8_amax_compute_algo, ("max", "most_recent"))
    check_positive("fp8_amax_history_len", config.fp8_amax_history_len)
    check_choice("fp8_gemm_impl", config.fp8_gemm_impl, GEMM_IMPLS)
    if config.fp8_gemm_impl == "torchao":
        if config.fp8_recipe != "tensorwise":
            raise ConfigError(
                f"fp8_gemm_impl torchao runs the tensorwise recipe only, not fp8_recipe "
                f"{config.fp8_recipe}; set fp8_recipe tensorwise or use fp8_gemm_impl scaled_mm",
                params=("fp8_gemm_impl", "fp8_recipe"),
            )
        error = torchao_error()
        if error:
            raise ConfigError(error, params=("fp8_gemm_impl",))
    if not config.bf16:
        raise ConfigError(
            f"fp8_format {config.fp8_format} needs bf16=True (FP8 GEMMs take bf16 activations and "
            "weights); set bf16=True",
            params=("fp8_format", "bf16"),
        )


def check_pipeline(config: Any) -> None:
    """The pipeline split of a ``TransformerConfig``: sizes, virtual stages, the layout string;
    sets ``virtual_pipeline_model_parallel_size`` from the per-stage count or the layout."""
    pp = config.pipeline_model_parallel_size
    check_positive("pipeline_model_parallel_size", pp)
    if config.pipeline_model_parallel_layout is not None:
        _apply_layout_string(config, pp)
    per_stage = config.num_layers_per_virtual_pipeline_stage
    if per_stage is not None:
        if config.virtual_pipeline_model_parallel_size is not None:
            raise ConfigError(
                "give num_layers_per_virtual_pipeline_stage or "
                "virtual_pipeline_model_parallel_size, not both",
                params=("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size"),
            )
        check_positive("num_layers_per_virtual_pipeline_stage", per_stage)
        # The embedding / loss count as layers here when account_for_*_in_pipeline_split say so (Megatron).
        counted = (
            config.num_layers
            + int(config.account_for_embedding_in_pipeline_split)
            + int(config.account_for_loss_in_pipeline_split)
        )
        what = (
            "num_layers"
            if counted == config.num_layers
            else "num_layers + the layers counted by account_for_embedding/loss_in_pipeline_split"
        )
        names = (
            "num_layers_per_virtual_pipeline_stage",
            "num_layers",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        )
        if counted % pp != 0:
            raise ConfigError(
                f"num_layers_per_virtual_pipeline_stage needs {what} ({counted}) divisible by "
                f"pipeline_model_parallel_size ({pp}); for an uneven split use "
                "virtual_pipeline_model_parallel_size with decoder_first_pipeline_num_layers / "
                "decoder_last_pipeline_num_layers",
                params=names,
            )
        if (counted // pp) % per_stage != 0:
            raise ConfigError(
                f"num_layers_per_virtual_pipeline_stage {per_stage} does not divide the "
                f"{what} {counted} / pipeline_model_parallel_size {pp} layers per stage; "
                f"use a divisor of {counted // pp}",
                params=names,
            )
        config.virtual_pipeline_model_parallel_size = counted // pp // per_stage
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is not None:
        check_positive("virtual_pipeline_model_parallel_size", vpp)
        if vpp == 1:
            config.virtual_pipeline_model_parallel_size = vpp = None
        elif pp == 1:
            raise ConfigError(
                "virtual pipeline stages (virtual_pipeline_model_parallel_size / "
                "num_layers_per_virtual_pipeline_stage) need pipeline_model_parallel_size > 1",
                params=(
                    "virtual_pipeline_model_parallel_size",
                    "num_layers_per_virtual_pipeline_stage",
                    "pipeline_model_parallel_size",
                ),
            )
    if config.microbatch_group_size_per_virtual_pipeline_stage is not None:
        check_positive(
            "microbatch_group_size_per_virtual_pipeline_stage",
            config.microbatch_group_size_per_virtual_pipeline_stage,
        )
    config.pipeline_layout(pp, vpp)  # raises


def _apply_layout_string(config: Any, pp: int) -> None:
    """``pipeline_model_parallel_layout``: checked, and its virtual stages per rank set."""
    if pp == 1:
        raise ConfigError(
            "pipeline_model_parallel_layout needs pipeline_model_parallel_size > 1",
            params=("pipeline_model_parallel_layout", "pipeline_model_parallel_size"),
        )
    layout = parse_layout(config.pipeline_model_parallel_layout, config.num_layers, pp)  # type: ignore[arg-type]
    vpp = layout.vpp if layout.vpp > 1 else None
    given = [
        name
        for name, value in (
            ("num_layers_per_virtual_pipeline_stage", config.num_layers_per_virtual_pipeline_stage),
            ("decoder_first_pipeline_num_layers", config.decoder_first_pipeline_num_layers),
            ("decoder_last_pipeline_num_layers", config.decoder_last_pipeline_num_layers),
            (
                "account_for_embedding_in_pipeline_split",
                config.account_for_embedding_in_pipeline_split or None,
            ),
            ("account_for_loss_in_pipeline_split", config.account_for_loss_in_pipeline_split or None),
        )
        if value is not None
    ]
    if config.virtual_pipeline_model_parallel_size not in (None, 1, vpp):
        given.append("virtual_pipeline_model_parallel_size")
    if given:
        raise ConfigError(
            f"pipeline_model_parallel_layout sets the whole split; drop {', '.join(given)}",
            params=("pipeline_model_parallel_layout", *given),
        )
    config.virtual_pipeline_model_parallel_size = vpp


def divisor_near(n: int, target: int, multiple_of: int = 1) -> int:
    """The divisor of ``n`` closest to ``target`` (for error messages that suggest a valid value),
    among those that are multiples of ``multiple_of`` when there are any (a hint for a count that the
    tensor-parallel size must also divide)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    fitting = [d for d in divisors if d % multiple_of == 0] or divisors
    return min(fitting, key=lambda d: (abs(d - target), d))


def check_tp_divides(config: Any, tp: int) -> None:
    """Heads, query groups and FFN channels split evenly over ``tp`` ranks."""
    for name, value in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", config.num_query_groups),
        ("ffn_hidden_size", config.ffn_hidden_size),
    ):
        assert value is not None, name  # filled in by __post_init__
        if value % tp != 0:
            raise ConfigError(
                f"{name} {value} is not divisible by tensor_model_parallel_size {tp}; "
                f"use a tensor-parallel size that divides it (e.g. {divisor_near(value, tp)})",
                params=(name, "tensor_model_parallel_size"),
            )


def check_parallelism(config: Any) -> None:
    """The parallel split (tensor-parallel divisibility, the pipeline fields) and the recompute fields of a
    ``TransformerConfig``, checked last on construction (after the defaults are filled in)."""
    tp = config.tensor_model_parallel_size
    check_positive("tensor_model_parallel_size", tp)
    check_tp_divides(config, tp)
    # sequence_parallel is kept as given: it applies where the process groups' tp size is > 1.
    check_pipeline(config)
    if config.recompute_granularity == "full":
        if config.recompute_method is None or not config.recompute_num_layers:
            raise ConfigError(
                "recompute_granularity full needs recompute_method uniform|block and "
                "recompute_num_layers N (e.g. recompute_method uniform recompute_num_layers 1)",
                params=("recompute_granularity", "recompute_method", "recompute_num_layers"),
            )
    elif config.recompute_method is not None:
        raise ConfigError(
            "recompute_method only applies with recompute_granularity full",
            params=("recompute_method", "recompute_granularity"),
        )
    check_positive("layernorm_epsilon", config.layernorm_epsilon)


def derive_shapes(cfg: Any, swiglu_default_ffn: bool) -> None:
    """Fill in and check the derived shape fields of a TransformerConfig: ``kv_channels`` (hidden /
    heads), ``num_query_groups`` (heads), ``ffn_hidden_size`` (4h, or SwiGLU's 8h/3 rounded to 64 when
    the ``swiglu`` flag asked for it), dropout ranges and the rotary channels.

    Raises:
        ConfigError: a shape that does not divide, or a value out of range, naming the field.
    """
    if cfg.kv_channels is None:
        if cfg.hidden_size % cfg.num_attention_heads != 0:
            raise ConfigError(
                f"num_attention_heads {cfg.num_attention_heads} does not divide hidden_size "
                f"{cfg.hidden_size}; use a head count that divides it (e.g. "
                f"{divisor_near(cfg.hidden_size, cfg.num_attention_heads)}) or set kv_channels",
                params=("num_attention_heads", "hidden_size", "kv_channels"),
            )
        cfg.kv_channels = cfg.hidden_size // cfg.num_attention_heads
    check_positive("kv_channels", cfg.kv_channels)
    if cfg.num_query_groups is None:
        cfg.num_query_groups = cfg.num_attention_heads
    check_positive("num_query_groups", cfg.num_query_groups)
    if cfg.num_attention_heads % cfg.num_query_groups != 0:
        hint = divisor_near(cfg.num_attention_heads, cfg.num_query_groups, cfg.tensor_model_parallel_size)
        raise ConfigError(
            f"num_query_groups {cfg.num_query_groups} must divide num_attention_heads "
            f"{cfg.num_attention_heads}; e.g. {hint}",
            params=("num_query_groups", "num_attention_heads"),
        )
    if cfg.ffn_hidden_size is None:
        if swiglu_default_ffn:
            cfg.ffn_hidden_size = int((8 * cfg.hidden_size / 3) / 64) * 64 or 64
        else:
            cfg.ffn_hidden_size = 4 * cfg.hidden_size
    check_positive("ffn_hidden_size", cfg.ffn_hidden_size)
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(cfg, name)
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {p}", params=(name,))
    if not 0.0 < cfg.rotary_percent <= 1.0:
        raise ConfigError(
            f"rotary_percent must be in (0, 1], got {cfg.rotary_percent}", params=("rotary_percent",)
        )
    if cfg.position_embedding_type == "rope" and cfg.rotary_dim % 2 != 0:
        raise ConfigError(
            f"rotary_percent {cfg.rotary_percent} x kv_channels {cfg.kv_channels} = {cfg.rotary_dim} "
            "rotary channels; it must be even (e.g. rotary_percent 1.0)",
            params=("rotary_percent", "kv_channels"),
        )


def _balancing_lists(config: Any) -> None:
    """One-value lists (the flags' ``nargs='+'``) become their value; several load-balancing types
    take one coefficient each (or one for all)."""
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(config, name)
        if isinstance(value, (list, tuple)) and len(value) == 1:
            setattr(config, name, value[0])
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    for t in types:
        check_choice("moe_router_load_balancing_type", t, LOAD_BALANCING_TYPES)
    if isinstance(coeffs, (list, tuple)) and len(coeffs) != len(types):
        raise ConfigError(
            f"moe_aux_loss_coeff {' '.join(map(str, coeffs))} gives {len(coeffs)} coefficients for "
            f"{len(types)} moe_router_load_balancing_type values; give one per type (or one)",
            params=("moe_aux_loss_coeff", "moe_router_load_balancing_type"),
        )
    for c in coeffs if isinstance(coeffs, (list, tuple)) else [coeffs]:
        if c < 0:
            raise ConfigError(f"moe_aux_loss_coeff must be >= 0, got {c}", params=("moe_aux_loss_coeff",))


def _moe_fields_without_experts(config: Any) -> list[str]:
    """The built MoE fields set away from their defaults (they need num_moe_experts)."""
    changed = {
        "moe_ffn_hidden_size": config.moe_ffn_hidden_size is not None,
        "moe_layer_freq": config.moe_layer_freq != 1,
        "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size is not None,
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_expert_capacity_factor": config.moe_expert_capacity_factor is not None,
        "expert_model_parallel_size": config.expert_model_parallel_size != 1,
    }
    return [name for name, set_ in changed.items() if set_]


def check_moe(config: Any) -> None:
    """The mixture-of-experts fields of a ``TransformerConfig`` (Megatron-Core's rules where it has
    them); sets ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), drops a negative capacity
    factor (no dropping, as Megatron-Core) and turns one-value lists of the ``nargs='+'`` fields into
    their value."""
    _balancing_lists(config)
    experts = config.num_moe_experts
    if experts is None:
        given = _moe_fields_without_experts(config)
        if given:
            raise ConfigError(
                f"{', '.join(given)} only apply to MoE layers; set num_moe_experts (e.g. 8) or drop them",
                params=(*given, "num_moe_experts"),
            )
        return
    check_positive("num_moe_experts", experts)
    check_positive("moe_router_topk", config.moe_router_topk)
    if config.moe_router_topk > experts:
        raise ConfigError(
            f"moe_router_topk {config.moe_router_topk} exceeds num_moe_experts {experts}; use at most {experts}",
            params=("moe_router_topk", "num_moe_experts"),
        )
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    check_positive("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    check_positive(
        "moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size, allow_none=True
    )
    _check_moe_layer_freq(config)
    _check_router(config)
    _check_capacity(config)
    _check_moe_parallelism(config)


def _check_moe_layer_freq(config: Any) -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        check_positive("moe_layer_freq", freq)
        return
    freq = list(freq)
    if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
        raise ConfigError(
            f"moe_layer_freq {freq} must give one 0 (dense) or 1 (MoE) per layer: num_layers "
            f"{config.num_layers} entries, e.g. [0]*1+[1]*{config.num_layers - 1}",
            params=("moe_layer_freq", "num_layers"),
        )
    if not any(freq):
        raise ConfigError(
            "moe_layer_freq marks no layer as MoE; give at least one 1, or drop num_moe_experts",
            params=("moe_layer_freq", "num_moe_experts"),
        )
    config.moe_layer_freq = freq


def _check_router(config: Any) -> None:
    check_choice("moe_router_score_function", config.moe_router_score_function, SCORE_FUNCTIONS)
    check_choice("moe_router_dtype", config.moe_router_dtype, (None, "fp32", "fp64"))
    check_choice("moe_token_drop_policy", config.moe_token_drop_policy, ("probs", "position"))
    check_positive("moe_z_loss_coeff", config.moe_z_loss_coeff, allow_none=True, allow_zero=True)
    check_positive("moe_input_jitter_eps", config.moe_input_jitter_eps, allow_none=True)
    check_positive("moe_router_topk_scaling_factor", config.moe_router_topk_scaling_factor, allow_none=True)
    check_positive("moe_router_bias_update_rate", config.moe_router_bias_update_rate, allow_zero=True)
    if config.moe_router_enable_expert_bias and config.moe_router_score_function == "softmax":
        raise ConfigError(
            "moe_router_enable_expert_bias (aux-loss-free balancing) needs moe_router_score_function "
            "sigmoid (or sqrtsoftplus), as in Megatron-Core",
            params=("moe_router_enable_expert_bias", "moe_router_score_function"),
        )
    _check_group_routing(config)


def _check_group_routing(config: Any) -> None:
    """Group-limited routing: E experts in G equal groups, a token picks g of them (scored by the sum
    of their top-(k / g) scores), then its k experts inside: g <= G, g divides k, k <= g x E / G."""
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    experts, k = config.num_moe_experts, config.moe_router_topk
    names = ("moe_router_num_groups", "moe_router_group_topk")
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ConfigError(
            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk "
            f"(e.g. moe_router_num_groups {_a_divisor(experts)} moe_router_group_topk 1)",
            params=names,
        )
    check_positive("moe_router_num_groups", groups)
    check_positive("moe_router_group_topk", group_topk)
    if experts % groups:
        raise ConfigError(
            f"moe_router_num_groups {groups} does not divide num_moe_experts {experts}; use a divisor "
            f"(e.g. {divisor_near(experts, groups)})",
            params=("moe_router_num_groups", "num_moe_experts"),
        )
    if group_topk > groups:
        raise ConfigError(
            f"moe_router_group_topk {group_topk} exceeds moe_router_num_groups {groups}; use at most {groups}",
            params=names,
        )
    if k % group_topk or k > group_topk * (experts // groups):
        raise ConfigError(
            f"moe_router_topk {k} with moe_router_group_topk {group_topk} groups of {experts // groups} "
            f"experts: k must be a multiple of {group_topk} up to {group_topk * (experts // groups)}",
            params=("moe_router_topk", *names, "num_moe_experts"),
        )


def _a_divisor(n: int) -> int:
    return next((d for d in (4, 2, 8) if n % d == 0 and d < n), n)


def _check_capacity(config: Any) -> None:
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor < 0:
        config.moe_expert_capacity_factor = factor = None  # Megatron-Core: negative means no dropping
    if factor is not None:
        check_positive("moe_expert_capacity_factor", factor)
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ConfigError(
            "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (e.g. 1.0)",
            params=("moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"),
        )


def _check_moe_parallelism(config: Any) -> None:
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if config.moe_token_dispatcher_type == "flex":
        raise ConfigError(
            "moe_token_dispatcher_type flex (DeepEP / HybridEP kernels) is not built; use alltoall",
            params=("moe_token_dispatcher_type",),
        )
    check_choice("moe_token_dispatcher_type", config.moe_token_dispatcher_type, DISPATCHERS)
    check_positive("expert_model_parallel_size", ep)
    if experts % ep:
        raise ConfigError(
            f"num_moe_experts {experts} is not divisible by expert_model_parallel_size {ep}; use an "
            f"expert-parallel size that divides it (e.g. {divisor_near(experts, ep)})",
            params=("num_moe_experts", "expert_model_parallel_size"),
        )
    etp = config.expert_tensor_parallel_size
    check_positive("expert_tensor_parallel_size", etp)
    if config.moe_ffn_hidden_size % etp:
        raise ConfigError(
            f"moe_ffn_hidden_size {config.moe_ffn_hidden_size} is not divisible by "
            f"expert_tensor_parallel_size {etp}; use a size that divides it "
            f"(e.g. {divisor_near(config.moe_ffn_hidden_size, etp)})",
            params=("moe_ffn_hidden_size", "expert_tensor_parallel_size"),
        )
    tp = config.tensor_model_parallel_size
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(
            f"moe_shared_expert_intermediate_size {shared} is not divisible by tensor_model_parallel_size "
            f"{tp}; use a multiple of {tp}",
            params=("moe_shared_expert_intermediate_size", "tensor_model_parallel_size"),
        )
    if tp > 1 and not config.sequence_parallel:
        raise ConfigError(
            f"MoE layers with tensor_model_parallel_size {tp} need sequence_parallel (as in "
            "Megatron-Core); set sequence_parallel=True",
            params=("tensor_model_parallel_size", "sequence_parallel"),
        )
    if etp > 1 and config.add_bias_linear:
        raise ConfigError(
            f"expert_tensor_parallel_size {etp} with add_bias_linear=True: expert biases split over "
            "expert-tp are not built; set add_bias_linear=False or expert_tensor_parallel_size 1",
            params=("expert_tensor_parallel_size", "add_bias_linear"),
        )
    if config.moe_shared_expert_overlap:
        if shared is None:
            raise ConfigError(
                "moe_shared_expert_overlap needs shared experts: set moe_shared_expert_intermediate_size",
                params=("moe_shared_expert_overlap", "moe_shared_expert_intermediate_size"),
            )
        if config.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(
                "moe_shared_expert_overlap overlaps the shared experts with the all-to-all: it needs "
                "moe_token_dispatcher_type alltoall (as in Megatron-Core)",
                params=("moe_shared_expert_overlap", "moe_token_dispatcher_type"),
            )
    if config.fp8_format is not None:
        raise ConfigError(
            f"fp8_format {config.fp8_format} with num_moe_experts: FP8 expert GEMMs are not built; "
            "drop fp8_format (train the MoE model in bf16)",
            params=("fp8_format", "num_moe_experts"),
        )
