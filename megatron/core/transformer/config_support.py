"""What each of Megatron-Core's ``TransformerConfig`` fields does here, and the derivations shared
with Megatron-Core (activation from ``gated_linear_unit`` + ``activation_func``, init methods).

Every 0.19.2 field is in one of three places: implemented (a field of ``TransformerConfig`` or
``ModelParallelConfig`` with its own documentation), ``*_NO_EFFECT`` (accepted at any value; a
performance, memory or logging knob of a mechanism not built here, or a field that matters only
together with a refused one) or ``*_REFUSED`` (accepted only at the listed values; anything else is
a ``ConfigError`` naming the field and what is possible). ``support_table()`` merges them for
docs/library.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.config_utils import ConfigError
from megatron.core.model_parallel_config import MPC_NO_EFFECT, MPC_REFUSED

_PERF = "a fusion / kernel choice of Megatron-Core's CUDA or Transformer Engine paths; no effect here"
_GLU_HALVES = "an expert's fc1 holds [gate; up] as two halves (no interleaving); leave it None"
_STACKED = "experts' weights are stacked per layer as linear_fc1.weight / linear_fc2.weight [E_local, ...]; leave it False"
_MTP = "only with multi-token prediction (mtp_num_layers), which is refused"
_CUDA_GRAPH = "CUDA graphs are not captured here (torch.compile is the training application's choice)"
_INFERENCE = "inference is out of scope of this package"
_MAMBA = "Mamba / hybrid models are not built (is_hybrid_model is refused)"
_DSA = "only with experimental_attention_variant, which is refused"
_OFFLOAD = "activations stay on the device (a memory knob)"
_MUP = "only with use_mup, which is refused"

TC_NO_EFFECT: dict[str, str] = {
    "attention_backend": "every backend runs torch's scaled_dot_product_attention, which picks its kernel",
    "flash_attention_version": "SDPA picks its flash kernel",
    "window_attn_skip_freq": "only with window_size, which is refused",
    "qk_clip_alpha": "only with qk_clip, which is refused",
    "qk_clip_threshold": "only with qk_clip, which is refused",
    "apply_query_key_layer_scaling": "SDPA scales by 1/sqrt(d) once (the same function); it sets "
    "attention_softmax_in_fp32 as in Megatron-Core",
    "attention_softmax_in_fp32": "SDPA accumulates its softmax in fp32",
    "disable_bf16_reduced_precision_matmul": "the library leaves torch's global matmul settings alone; the training "
    "application's flag of this name sets it at start-up",
    "activation_func_fp8_input_store": "FP8 SwiGLU stores what its kernels need",
    "distribute_saved_activations": "recomputed layers keep their whole input (a memory knob)",
    "mtp_loss_scaling_factor": _MTP,
    "mtp_use_repeated_layer": _MTP,
    "mtp_detach_heads": _MTP,
    "mtp_hybrid_override_pattern": _MTP,
    "fp8_margin": "the FP8 scales use no margin",
    "fp8_interval": "FP8 amaxes are updated every step",
    "fp8_quantizer_factory": "only with fp8_recipe='custom', which is refused",
    "fp4_recipe": "only with fp4, which is refused",
    "fp4_param": "only with fp4, which is refused",
    "fp4_quantizer_factory": "only with fp4, which is refused",
    "kitchen_attention_backend": "only with use_kitchen, which is refused",
    "clone_scatter_output_in_embedding": "the embedding's sequence-parallel scatter returns its own tensor",
    "config_logger_dir": "configs are logged by the training application (its argument dump)",
    "hetereogenous_dist_checkpoint": "only with heterogeneous_block_specs, which is refused",
    "mlp_chunks_for_training": "the MLP runs unchunked",
    "mlp_chunks_for_prefill": _INFERENCE,
    "min_offloaded_tensor_size": _OFFLOAD,
    "offload_modules": _OFFLOAD,
    "delay_offload_until_cuda_graph": _OFFLOAD,
    "delta_offload_bytes_across_pp_ranks": _OFFLOAD,
    "activation_offload_fraction": _OFFLOAD,
    "fine_grained_activation_offloading": _OFFLOAD,
    "fine_grained_offloading_max_inflight_offloads": _OFFLOAD,
    "batch_invariant_mode": "kernels are not swapped for batch-invariant ones",
    "symmetric_ar_type": _PERF,
    "nccl_all_reduce_for_prefill": _INFERENCE,
    "transformer_impl": "layers are this package's own modules ('local'); 'transformer_engine' builds them too",
    **{
        name: _PERF
        for name in (
            "masked_softmax_fusion",
            "persist_layer_norm",
            "memory_efficient_layer_norm",
            "bias_dropout_fusion",
            "apply_rope_fusion",
            "use_fused_weighted_squared_relu",
            "fused_single_qkv_rope",
            "use_transformer_engine_op_fuser",
            "disable_parameter_transpose_cache",
            "use_te_activation_func",
            "use_te_rng_tracker",
            "use_grouped_gemm_for_dense_mlp",
            "fused_residual_rmsnorm",
        )
    },
    **{
        name: _CUDA_GRAPH
        for name in (
            "enable_cuda_graph",
            "cuda_graph_use_single_mempool",
            "cuda_graph_retain_backward_graph",
            "cuda_graph_warmup_steps",
            "external_cuda_graph",
            "cuda_graph_impl",
            "cuda_graph_modules",
            "cuda_graph_scope",
        )
    },
    **{
        name: _INFERENCE
        for name in (
            "flash_decode",
            "inference_rng_tracker",
            "inference_sampling_seed",
            "use_inference_optimized_layers",
            "inference_fuse_tp_communication",
            "inference_disable_triton_nvls_kernels",
            "inference_grouped_gemm_backend",
            "inference_moe_disable_fused_quant_kernels",
            "inference_moe_token_dispatcher_type",
            "inference_cuda_graph_scope",
            "moe_pad_experts_for_cuda_graph_inference",
        )
    },
    **{
        name: _MAMBA
        for name in (
            "mamba_state_dim",
            "mamba_head_dim",
            "mamba_num_groups",
            "mamba_num_heads",
            "mamba_training_ssm_states_dtype",
            "use_mamba_mem_eff_path",
        )
    },
    **{
        name: _DSA
        for name in (
            "experimental_attention_variant_loss_scale_func",
            "dsa_indexer_n_heads",
            "dsa_indexer_head_dim",
            "dsa_indexer_topk",
            "dsa_indexer_topk_freq",
            "dsa_indexer_skip_topk_offset",
            "dsa_indexer_loss_coeff",
            "dsa_indexer_use_sparse_loss",
            "dsa_kernel_backend",
            "dsa_indexer_rope_interleaved",
            "dsa_indexer_rotate_activation",
            "dsa_indexer_scoring_relu",
            "dsa_indexer_k_norm_epsilon",
            "dsa_indexer_k_norm_fp32",
            "linear_attention_freq",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
    },
    **{
        name: _MUP
        for name in (
            "mup_width_mult",
            "mup_base_hidden_size",
            "mup_embedding_mult",
            "mup_output_mult",
            "mup_base_head_dim",
            "mup_attn_scale_power",
        )
    },
}

# The MoE fields of mechanisms not built whose value changes nothing here (the refused ones are in
# TC_REFUSED, the built ones are fields of MoEConfigFields).
_FLEX = "only with the flex token dispatcher (DeepEP / HybridEP / NCCL-EP), which is not built"
_MOE_PERF = "a performance knob of Megatron-Core's expert kernels or overlap; no effect here"
TC_NO_EFFECT.update(
    {
        "moe_flex_dispatcher_backend": _FLEX,
        "moe_permute_fusion_into_hybridep": _FLEX,
        "moe_hybridep_pad_uneven_dispatch_inputs": _FLEX,
        "moe_flex_dispatcher_num_sms": _FLEX,
        "moe_deepep_num_sms": _FLEX,
        "moe_hybridep_num_sms": _FLEX,
        "moe_hybridep_num_blocks_permute": _FLEX,
        "moe_hybridep_num_blocks_unpermute": _FLEX,
        "moe_hybridep_num_sms_preprocessing": _FLEX,
        "moe_ncclep_static_shape": _FLEX,
        "moe_ncclep_zero_copy": _FLEX,
        "moe_router_quantile_balancing_ema": "only with quantile load balancing, which is not built",
        "moe_token_dropping": "Megatron-Core's placeholder (it does nothing there either); dropping is "
        "moe_expert_capacity_factor",
        "moe_permute_fusion": "tokens are permuted with torch ops (index_select / scatter)",
        "moe_router_fusion": "the router's top-k and scores run as torch ops",
        "use_grouped_gemm_for_shared_expert": "the shared experts run as one dense MLP",
        "moe_paged_stash": _OFFLOAD,
        "moe_paged_stash_page_size": _OFFLOAD,
        "moe_paged_stash_buffer_size_factor_cuda": _OFFLOAD,
        "moe_paged_stash_buffer_size_factor_cpu": _OFFLOAD,
        "high_priority_a2a_comm_stream": _MOE_PERF,
    }
)

_INIT = (
    "weights are initialised from init_method_std (normal; output projections std / sqrt(2 num_layers)) "
    "from the seed and each parameter's global name; leave it None and set init_method_std"
)

TC_REFUSED: dict[str, tuple[tuple, str]] = {
    "mtp_num_layers": ((None,), "multi-token prediction is not built; leave it None"),
    "multi_latent_attention": ((False,), "multi-latent attention (MLA) is not built; leave it False"),
    "experimental_attention_variant": (
        (None,),
        "only standard (grouped-query) attention is built; leave it None",
    ),
    "is_hybrid_model": ((False,), "Mamba / hybrid models are not built; leave it False"),
    "heterogeneous_block_specs": ((False,), "all layers share one spec here; leave it False"),
    "window_size": ((None,), "sliding-window attention is not built; leave it None (full causal attention)"),
    "softmax_type": (("vanilla",), "only the standard softmax is built; use 'vanilla'"),
    "fp32_residual_connection": ((False,), "the residual stream is kept in params_dtype; leave it False"),
    "apply_residual_connection_post_layernorm": (
        (False,),
        "layers are pre-norm with the residual taken before the norm; leave it False",
    ),
    "glu_linear_offset": ((0.0,), "the GLU is act(gate) * up; leave it 0.0"),
    "activation_func_clamp_value": ((None,), "activations are not clamped; leave it None"),
    "rotary_interleaved": ((False,), "RoPE rotates halves (the non-interleaved layout); leave it False"),
    "qk_l2_norm": ((False,), "query/key L2 norm is not built; use qk_layernorm=True or leave it False"),
    "qk_clip": ((False,), "QK-clip is not built; leave it False"),
    "log_max_attention_logit": ((False,), "the max attention logit is not computed (SDPA); leave it False"),
    "attention_output_gate": ((False,), "gated attention output is not built; leave it False"),
    "no_rope_freq": ((None,), "every layer applies RoPE (with rope position embeddings); leave it None"),
    "use_mup": ((False,), "muP initialisation and scaling are not built; leave it False"),
    "embedding_init_method": ((None,), _INIT),
    "use_kitchen": ((False,), "NVIDIA Kitchen is not used; leave it False"),
    "use_kitchen_attention": ((False,), "NVIDIA Kitchen is not used; leave it False"),
    "fp8_param": ((False,), "weights stay in bf16 under FP8 compute; leave it False"),
    "fp8_wgrad": ((True,), "weight gradients follow the FP8 recipe; leave it True"),
    "fp8_output_proj": ((False,), "FP8 covers the linears of each layer as fp8 says; leave it False"),
    "fp8_dot_product_attention": ((False,), "attention runs in bf16 (SDPA); leave it False"),
    "fp8_multi_head_attention": ((False,), "attention runs in bf16 (SDPA); leave it False"),
    "fp4": ((None,), "FP4 is not built; leave it None (FP8: fp8='e4m3' or 'hybrid')"),
    "mrope_section": ((None,), "multimodal RoPE is not built; leave it None"),
    "quant_recipe": ((None,), "quantization recipes are not built (FP8: fp8 and fp8_recipe); leave it None"),
    "moe_router_padding_for_fp8": ((False, None), "FP8 expert GEMMs are not built; leave it False"),
    "moe_router_padding_for_quantization": (
        (False, None),
        "quantized expert GEMMs are not built; leave it False",
    ),
    "moe_shared_expert_glu_interleave_size": ((None,), _GLU_HALVES),
    "moe_mlp_glu_interleave_size": ((None,), _GLU_HALVES),
    "moe_enable_routing_replay": ((False,), "routing replay is not built; leave it False"),
    "moe_router_topk_limited_devices": (
        (None,),
        "device-limited routing is moe_router_num_groups = ep size with moe_router_group_topk; leave it None",
    ),
    "moe_router_force_load_balancing": ((False,), "forced (benchmark) routing is not built; leave it False"),
    "moe_router_force_biased": ((None,), "forced (benchmark) routing is not built; leave it None"),
    "moe_single_grouped_weight": ((False,), _STACKED),
    "moe_single_grouped_bias": ((False,), _STACKED),
    "moe_enable_deepep": (
        (False,),
        "the flex dispatcher (DeepEP) is not built; use moe_token_dispatcher_type alltoall",
    ),
    "moe_layer_recompute": (
        (False,),
        "recompute whole layers with recompute_granularity full; leave it False",
    ),
    "moe_apply_probs_on_input": ((False,), "routing weights scale the experts' outputs; leave it False"),
    "moe_latent_size": ((None,), "latent MoE (a projection around the experts) is not built; leave it None"),
    "moe_expert_rank_capacity_factor": (
        (None,),
        "per-rank capacity is not built; use moe_expert_capacity_factor",
    ),
    "test_mode": ((False,), "Megatron-Core's test hooks are not built; leave it False"),
}


# Megatron-Core fields declared in the base classes that this package implements (the others it
# implements are redeclared, with their documentation and flags, in TransformerConfig).
IMPLEMENTED: dict[str, str] = {
    "perform_initialization": "False leaves the parameters uninitialised (to be loaded from a checkpoint)",
    "fp8": "Megatron-Core's name of fp8_format (both read the same)",
    "num_layers_in_first_pipeline_stage": "Megatron-Core's name of decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "Megatron-Core's name of decoder_last_pipeline_num_layers",
    "microbatch_group_size_per_vp_stage": "Megatron-Core's name of microbatch_group_size_per_virtual_pipeline_stage",
    "softmax_scale": "the attention scale; None: 1/sqrt(kv_channels)",
    "bias_activation_fusion": "True makes a biased GELU MLP compute the tanh GELU (Megatron-Core's bias-GELU "
    "kernel); it needs add_bias_linear with F.gelu. False (the default) computes the "
    "exact GELU, as Megatron-Core; our bias_gelu_fusion=True (the training "
    "application's default) is the same switch",
    "init_method": "set to N(0, init_method_std^2) on construction; a user-given callable is refused",
    "output_layer_init_method": "set to N(0, (init_method_std / sqrt(2 num_layers))^2); a user-given callable "
    "is refused",
    "embedding_init_method_std": "defaults to init_method_std; another value is refused",
}


def support_table() -> dict[str, str]:
    """Every Megatron-Core field not documented on TransformerConfig itself -> what it does here."""
    table = dict(IMPLEMENTED)
    table.update({name: f"no effect: {why}" for name, why in {**MPC_NO_EFFECT, **TC_NO_EFFECT}.items()})
    for name, (accepted, hint) in {**MPC_REFUSED, **TC_REFUSED}.items():
        table[name] = f"refused unless {' or '.join(map(repr, accepted))}: {hint}"
    return table


# ---------------------------------------------------------------------------------------------------
# Activation: Megatron-Core's (gated_linear_unit, activation_func) <-> this package's `activation`.


def activation_name(gated_linear_unit: bool, activation_func: Callable) -> str:
    """The MLP this package builds for Megatron-Core's activation fields: ``"gelu"`` for ``F.gelu``
    without a GLU, ``"swiglu"`` for ``F.silu`` with one.

    Raises:
        ConfigError: any other combination (GeGLU, ReLU, a custom function), naming the fields.
    """
    if not gated_linear_unit and activation_func is F.gelu:
        return "gelu"
    if gated_linear_unit and activation_func is F.silu:
        return "swiglu"
    name = getattr(activation_func, "__name__", repr(activation_func))
    raise ConfigError(
        f"TransformerConfig.activation_func={name} with gated_linear_unit={gated_linear_unit} is not "
        "built here; use activation_func=F.gelu (GELU MLP) or gated_linear_unit=True with "
        "activation_func=F.silu (SwiGLU)",
        params=("activation_func", "gated_linear_unit"),
    )


# ---------------------------------------------------------------------------------------------------
# Init methods: what Megatron-Core's config holds after construction. The model's own
# initialisation is seeded per parameter (tensor_parallel.init); these callables are what code that
# builds its own modules calls, with the same distributions.


def _normal_init(std: float) -> Callable[[torch.Tensor], Any]:
    fn = functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
    fn.derived_from_init_method_std = True  # type: ignore[attr-defined]
    return fn


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], Any]:
    """Fills a tensor from N(0, sigma^2)."""
    return _normal_init(sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], Any]:
    """Fills a tensor from N(0, (sigma / sqrt(multiplier * num_layers))^2): output projections."""
    return _normal_init(sigma / math.sqrt(multiplier * num_layers))


def derive_init_methods(config: Any) -> None:
    """Set ``init_method`` / ``output_layer_init_method`` from ``init_method_std`` (Megatron-Core's
    defaults) and ``embedding_init_method_std`` to ``init_method_std``.

    Raises:
        ConfigError: a user-given init callable, or an embedding std other than ``init_method_std``.
    """
    for name in ("init_method", "output_layer_init_method"):
        fn = getattr(config, name)
        if fn is not None and not getattr(fn, "derived_from_init_method_std", False):
            raise ConfigError(
                f"TransformerConfig.{name}={fn!r} is not supported here: {_INIT}", params=(name,)
            )
    if config.embedding_init_method_std is None:
        config.embedding_init_method_std = config.init_method_std
    elif config.embedding_init_method_std != config.init_method_std:
        raise ConfigError(
            f"TransformerConfig.embedding_init_method_std={config.embedding_init_method_std} is not "
            f"supported here: the embedding uses init_method_std ({config.init_method_std}); leave it "
            "None or equal to init_method_std",
            params=("embedding_init_method_std", "init_method_std"),
        )
    config.init_method = init_method_normal(config.init_method_std)
    config.output_layer_init_method = scaled_init_method_normal(config.init_method_std, config.num_layers)
