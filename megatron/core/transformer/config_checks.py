"""The derived shapes and split rules of a ``TransformerConfig`` (FP8, tensor- and pipeline-parallel,
recompute fields), checked on construction.

Kept beside the config so that ``transformer_config`` holds the fields and their documentation;
each check raises ``ConfigError`` naming the fields (``params``) and a value that would be valid.
"""

from __future__ import annotations

from typing import Any

from megatron.core.config_utils import ConfigError, check_choice, check_positive
from megatron.core.fusions.fp8 import GEMM_IMPLS, torchao_error
from megatron.core.pipeline_parallel.layout import parse_layout


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
