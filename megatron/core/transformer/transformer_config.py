"""TransformerConfig: the shape and numerics of a GPT-style decoder, validated on construction.

It is Megatron-Core's ``TransformerConfig`` (a ``ModelParallelConfig``): every 0.19.2 field exists with
Megatron-Core's default. The fields below and the mixture-of-experts fields (``moe_config_fields``)
are the ones this package implements, documented and turned into the training application's flags;
the rest (``mcore_config_fields``) are accepted without effect or refused as ``config_support`` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.config_utils import ConfigError, check_choice, check_positive, doc
from megatron.core.model_parallel_config import check_refused
from megatron.core.pipeline_parallel.layout import PipelineLayout, build_pipeline_layout
from megatron.core.transformer import config_aliases, config_checks, config_support
from megatron.core.transformer.moe_config_fields import MoEConfigFields

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass
class TransformerConfig(MoEConfigFields):
    """Model shape and numerics. Field docs double as the ``--help`` text of the matching flags.

    Megatron-Core's activation fields and this package's ``activation`` are one setting:
    ``gated_linear_unit=True, activation_func=F.silu`` and ``activation="swiglu"`` (``--swiglu``) build
    the same SwiGLU MLP and all three read so after construction; ``F.gelu`` without a GLU is "gelu".
    """

    num_layers: int = doc(0, "Number of transformer layers.")
    hidden_size: int = doc(0, "Transformer hidden size h.")
    num_attention_heads: int = doc(0, "Number of query attention heads.")
    num_query_groups: int | None = doc(
        None,
        "Number of key/value head groups for grouped-query attention (1 = multi-query). Used only with "
        "--group-query-attention; default: one group per head (multi-head attention).",
    )
    kv_channels: int | None = doc(
        None, "Per-head projection size d. Default: hidden_size / num_attention_heads."
    )
    ffn_hidden_size: int | None = doc(
        None,
        "MLP hidden size F. Default: 4h, or int(8h/3 / 64) * 64 with --swiglu (rounded as Megatron does).",
    )
    normalization: str = doc("LayerNorm", "Normalization layer.", choices=NORMALIZATIONS)
    layernorm_epsilon: float = doc(1e-5, "Epsilon of LayerNorm / RMSNorm.", flag="--norm-epsilon")
    apply_layernorm_1p: bool = doc(
        False,
        "Zero-centred norm weights (Megatron-LM's LayerNorm 1p): every LayerNorm / RMSNorm weight w "
        "(the layers' norms, the final norm and the QK-norms) is stored and initialised as 0 and applied as "
        "(1 + w); the LayerNorm bias is unchanged. The same function as a plain norm of weight 1 + w. "
        "Checkpoints record it: their norm weights read differently with and without it.",
    )
    layernorm_zero_centered_gamma: bool = doc(
        False,
        "Megatron-Core's name of apply_layernorm_1p (either turns it on; both read True after construction).",
        flag=None,
    )
    activation: str = doc(
        "gelu",
        "MLP activation; set to swiglu by --swiglu. Kept in step with gated_linear_unit and "
        "activation_func (Megatron-Core's fields).",
        flag=None,
    )
    gated_linear_unit: bool = doc(
        False,
        "Megatron-Core's gated MLP (fc1 produces [gate; up]); with activation_func=F.silu it is SwiGLU. "
        "Default ffn_hidden_size: 4h, as in Megatron-Core (the --swiglu flag's default is int(8h/3 / 64) * 64).",
        flag=None,
    )
    activation_func: Callable = doc(
        F.gelu,
        "Megatron-Core's MLP activation function: F.gelu (GELU) or, with gated_linear_unit, F.silu "
        "(SwiGLU); others are refused.",
        flag=None,
    )
    add_bias_linear: bool = doc(
        True, "Biases in all linear layers; turned off by --disable-bias-linear.", flag=None
    )
    bias_gelu_fusion: bool = doc(
        False,
        "GELU with biases as Megatron-LM's bias-GELU fusion computes it (on by default in the training "
        "application): the tanh approximation of GELU, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))). "
        "--no-bias-gelu-fusion computes the exact erf GELU instead; models without biases (--disable-bias-linear) "
        "always do, as in Megatron-LM. Library default: off (exact GELU), as Megatron-Core's "
        "bias_activation_fusion=False.",
        flag="--no-bias-gelu-fusion",
        app_default=True,
    )
    add_qkv_bias: bool = doc(False, "Bias in the QKV projection even when --disable-bias-linear is given.")
    qk_layernorm: bool = doc(False, "Normalize queries and keys per head before attention (same norm type).")
    position_embedding_type: str = doc("learned_absolute", "Position embedding.", choices=POSITION_EMBEDDINGS)
    rotary_base: int = doc(10000, "RoPE base (theta). Only with --position-embedding-type rope.")
    rotary_percent: float = doc(1.0, "Fraction of each head's channels that RoPE rotates. Only with rope.")
    rotary_seq_len_interpolation_factor: float | None = doc(
        None,
        "RoPE linear position interpolation: positions are multiplied by 1 / this factor before the "
        "rotation angles are computed (position p rotates as p / factor), so a model trained at S tokens "
        "covers factor x S. Only with rope. Default: none (positions as they are).",
    )
    rope_scaling: bool = doc(
        False,
        "Llama 3.x's RoPE frequency scaling (Hugging Face's rope_type llama3): long wavelengths divided by "
        "--rope-scaling-factor, with low/high frequency factors 1 and 4 over 8192 original positions. Only "
        "with rope.",
        flag="--use-rope-scaling",
    )
    rope_scaling_factor: float = doc(8.0, "The factor of --use-rope-scaling (Llama 3.1/3.2/3.3: 8 or 32).")
    hidden_dropout: float = doc(0.1, "Dropout probability on the residual branches and embeddings.")
    attention_dropout: float = doc(0.1, "Dropout probability on attention probabilities.")
    init_method_std: float = doc(
        0.02,
        "Std of the normal init of weights; output projections (linear_proj, linear_fc2) use std/sqrt(2L).",
    )
    share_embeddings_and_output_weights: bool = doc(
        False,
        "Tie the output layer to the word embedding. GPTModel's argument of the same name overrides it. "
        "Library default: untied, as Megatron-Core's GPTModel; the training application ties them unless "
        "--untie-embeddings-and-output-weights is given, as Megatron-LM.",
        flag=None,
        app_default=True,
    )
    params_dtype: torch.dtype = doc(
        torch.float32, "Dtype of model parameters; bf16/fp16 from --bf16/--fp16.", flag=None
    )
    pipeline_dtype: torch.dtype | None = doc(
        None,
        "Megatron-Core's dtype of the activations sent between pipeline stages. Here they are always "
        "sent in params_dtype (the dtype the layers compute in); a different value is refused. Default: "
        "params_dtype.",
        flag=None,
    )
    init_model_with_meta_device: bool = doc(
        False,
        "With --use-torch-fsdp2: build the model on the meta device and let each rank allocate and "
        "initialise only its shards (the same weights as a single-process run). Without FSDP every rank "
        "already materialises only its tensor/pipeline shard.",
    )
    use_cpu_initialization: bool = doc(
        False,
        "Allocate and initialise the model's parameters in CPU memory, then move the whole model to "
        "its device (GPTModel's device argument; the training application's GPU). The values are the same "
        "either way: every weight is generated on the CPU from the seed and the parameter's global name (this "
        "rank's shard of the logical tensor, whatever the layout) and then copied. Without the flag the "
        "parameters are allocated on the device and each is copied there as soon as it is generated, so the "
        "CPU holds one parameter at a time instead of the whole model.",
    )
    fp16: bool = doc(
        False, "Model params and compute in fp16 (with dynamic loss scaling unless --loss-scale)."
    )
    bf16: bool = doc(False, "Model params and compute in bf16 (fp32 main params and grads in the optimizer).")
    tensor_model_parallel_size: int = doc(
        1,
        "Tensor-parallel degree: heads, FFN and vocabulary are split over this many ranks. The training "
        "application builds the process groups from it; models take the size from their process groups (as "
        "Megatron-Core's layers do from parallel_state): a config left at 1 follows the groups, any other "
        "value must equal their size.",
    )
    pipeline_model_parallel_size: int = doc(
        1,
        "Pipeline-parallel degree: the layers are split into this many stages, one per rank of a pipeline. "
        "Like --tensor-model-parallel-size, models take it from their process groups; 1 follows the groups.",
    )
    virtual_pipeline_model_parallel_size: int | None = doc(
        None,
        "Virtual pipeline chunks per pipeline rank (interleaved 1F1B); chunk c on pipeline rank r holds "
        "virtual stage c*pp + r. Needs --pipeline-model-parallel-size > 1. Default: no interleaving.",
    )
    num_layers_per_virtual_pipeline_stage: int | None = doc(
        None,
        "Layers per virtual pipeline stage; sets --virtual-pipeline-model-parallel-size to "
        "(num_layers / pp) / this value (num_layers including the layers counted by --account-for-*). Give at most "
        "one of the two.",
    )
    decoder_first_pipeline_num_layers: int | None = doc(
        None, "Layers on the first pipeline stage (uneven split); the others split the rest evenly."
    )
    decoder_last_pipeline_num_layers: int | None = doc(
        None, "Layers on the last pipeline stage (uneven split); the others split the rest evenly."
    )
    account_for_embedding_in_pipeline_split: bool = doc(
        False,
        "Count the embedding as one layer in the even pipeline split: the first virtual stage builds one "
        "transformer layer fewer (num-layers + 1, + 1 more with the loss flag, must divide into pp x virtual stages).",
    )
    account_for_loss_in_pipeline_split: bool = doc(
        False,
        "Count the output layer and loss as one layer in the even pipeline split: the last virtual stage "
        "builds one transformer layer fewer.",
    )
    pipeline_model_parallel_layout: str | None = doc(
        None,
        "Every virtual pipeline stage's layers in one string (Megatron's syntax), stages in virtual order "
        "separated by '|': t a transformer layer, E the embedding (first stage), L the output layer and loss "
        '(last stage); x*n and (...)*n repeat, commas are cosmetic. E.g. "Et*9|t*9|t*9|t*5L" (pp 4) or '
        '"Et*5|t*5|t*4|t*3|(t*4|)*3,t*3L" (pp 4 x 2 virtual stages). Stages may differ in size; stages / pp sets the '
        "virtual stages per rank. Replaces --decoder-first/last-pipeline-num-layers and the virtual-stage flags.",
    )
    microbatch_group_size_per_virtual_pipeline_stage: int | None = doc(
        None,
        "Interleaved schedule: micro-batches run per chunk before switching chunks (G). Needs "
        "pp <= G <= micro-batches and micro-batches mod G either 0 or >= pp. Default: pp.",
    )
    overlap_p2p_comm: bool = doc(
        False,
        "Interleaved schedule: exchange activations while the round's backward runs and gradients "
        "while the next round's forward runs, instead of waiting for each exchange before computing on. "
        "--no-overlap-p2p-communication waits (the order of messages is the same either way).",
        flag="--no-overlap-p2p-communication",
        app_default=True,
    )
    context_parallel_size: int = doc(
        1,
        "Context-parallel degree: every sequence is cut into 2 x this many chunks and cp rank r holds "
        "chunks r and 2N-1-r (balanced causal work); attention exchanges keys and values between them "
        "(--cp-comm-type). Weights are replicated over cp; gradients are reduced over dp x cp. Needs "
        "--seq-length divisible by 2 x this. Like --tensor-model-parallel-size, models take it from "
        "their process groups; 1 follows the groups.",
    )
    cp_comm_type: str | list[str] | None = doc(
        None,
        "How context-parallel attention communicates: 'p2p' (ring: key/value blocks travel around the "
        "cp ranks while the current block is attended), 'a2a' (all-to-all: heads for sequence; the "
        "query groups per tp rank must divide by the cp size), 'allgather' (gather all keys and "
        "values), 'a2a+p2p' (all-to-all inside the first level of --hierarchical-context-parallel-sizes, "
        "ring across the second). One value for every layer, or one per layer.",
        flag="--cp-comm-type",
        nargs="+",
        app_default=["p2p"],
    )
    hierarchical_context_parallel_sizes: list[int] | None = doc(
        None,
        "With --cp-comm-type a2a+p2p: the two levels' sizes [a2a, p2p], multiplying to "
        "--context-parallel-size (the a2a level is consecutive cp ranks, e.g. the GPUs of a node).",
        nargs="+",
    )
    sequence_parallel: bool = doc(
        False,
        "With tensor parallelism, keep norms, dropout and residuals sharded along the sequence "
        "(all-gather / reduce-scatter around the tensor-parallel matmuls). Ignored when the TP size is 1.",
    )
    recompute_granularity: str | None = doc(
        None,
        "Activation recompute: 'full' recomputes whole layers in backward, 'selective' only the "
        "core attention.",
        choices=("full", "selective"),
    )
    recompute_modules: list[str] | None = doc(
        None,
        "With --recompute-granularity selective: what runs again in backward instead of keeping its "
        "activations: 'core_attn' (the core attention; the default) and/or 'moe' (each MoE layer whole: "
        "router, dispatch, experts, combine). Megatron-LM's other modules are refused.",
        flag="--recompute-modules",
        nargs="+",
    )
    recompute_method: str | None = doc(
        None,
        "With full recompute: 'uniform' checkpoints chunks of --recompute-num-layers layers; 'block' "
        "checkpoints only the first --recompute-num-layers layers of each stage.",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int | None = doc(
        None, "Layers per recompute chunk (uniform) or recomputed layers (block)."
    )
    calculate_per_token_loss: bool = doc(
        False,
        "Normalise the loss by the global token count of the step (summed over micro-batches and "
        "data-parallel ranks) instead of averaging per-micro-batch means.",
    )
    cross_entropy_loss_fusion: bool = doc(
        False,
        "Compute the output layer and the cross entropy together in chunks of tokens, never holding "
        "the full [tokens, vocabulary] logits (the softmax stays fp32). Applies with tensor-parallel size 1; "
        "with tp > 1 the vocab-parallel cross entropy is used. --no-cross-entropy-loss-fusion turns it off.",
        app_default=True,
    )
    fp8_format: str | None = doc(
        None,
        "Run the transformer layers' linears (QKV, proj, fc1, fc2; not the output layer or embedding) "
        "in FP8 with torch._scaled_mm: 'e4m3' everywhere, or 'hybrid' (e4m3 forward, e5m2 gradients). "
        "Compute only: weights and checkpoints stay bf16. Needs --bf16 and a Hopper GPU (H100/H200). "
        "Default: off.",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str = doc(
        "delayed",
        "FP8 scaling: 'tensorwise' scales each tensor by its current amax; 'delayed' by an amax "
        "history of previous steps (see --fp8-amax-history-len). Only with --fp8-format.",
        choices=("tensorwise", "delayed"),
    )
    fp8_amax_history_len: int = doc(
        1,
        "Delayed FP8 scaling: amax entries kept per tensor (one per forward or backward call). "
        "Only with --fp8-format and --fp8-recipe delayed. Library default 1, as Megatron-Core.",
        app_default=1024,
    )
    fp8_amax_compute_algo: str = doc(
        "most_recent",
        "Delayed FP8 scaling: the amax of a tensor is the 'max' over its history or the "
        "'most_recent' entry. Only with --fp8-format and --fp8-recipe delayed. Library default 'most_recent', "
        "as Megatron-Core.",
        choices=("max", "most_recent"),
        app_default="max",
    )
    tp_only_amax_red: bool = doc(
        False,
        "Delayed FP8 scaling: reduce each tensor's amax (max over the ranks, before it enters the history) "
        "over the tensor-parallel ranks only, instead of over the tensor-, context- and data-parallel ranks of "
        "the pipeline stage (the default, so that every rank uses the same scales). Only with --fp8-format.",
    )
    first_last_layers_bf16: bool = doc(
        False,
        "FP8: keep the linears of the first --num-layers-at-start-in-bf16 and the last "
        "--num-layers-at-end-in-bf16 transformer layers (counted over the whole model, across pipeline "
        "stages) in bf16, the rest in FP8. Only with --fp8-format.",
    )
    num_layers_at_start_in_bf16: int = doc(
        1, "Transformer layers at the start kept in bf16 under --first-last-layers-bf16."
    )
    num_layers_at_end_in_bf16: int = doc(
        1, "Transformer layers at the end kept in bf16 under --first-last-layers-bf16."
    )
    fp8_gemm_impl: str = doc(
        "scaled_mm",
        "Who runs the FP8 GEMMs: 'scaled_mm' (ours: torch._scaled_mm, with Triton cast-transpose "
        "kernels quantising in one pass; the default and the faster on an H200) or 'torchao' (torchao's float8 "
        "training; tensorwise recipe only; needs torchao installed). Same quantisation (docs/performance.md). "
        "Only with --fp8-format.",
        choices=("scaled_mm", "torchao"),
    )
    # Hooks the training application sets for the schedules (not flags).
    grad_scale_func: Callable | None = doc(
        None, "Scales the loss before backward (fp16 loss scaling).", flag=None
    )
    no_sync_func: Any = doc(
        None,
        "Context manager that defers gradient reduction (a list of them, one per model chunk, with virtual pipeline stages).",
        flag=None,
    )
    finalize_model_grads_func: Callable | None = doc(
        None, "Reduces gradients after the last backward.", flag=None
    )

    # Fields with an app_default keep Megatron-Core's default in the library and Megatron-LM's flag
    # default in the training application (config_utils.flag_default).

    @property
    def gelu_approximation(self) -> str:
        """``F.gelu``'s ``approximate`` argument: ``"tanh"`` for a biased GELU MLP with the bias-GELU fusion
        (Megatron-LM's default; Megatron-Core's ``bias_activation_fusion=True``), else ``"none"`` (exact erf GELU)."""
        fused = self.bias_gelu_fusion or self.bias_activation_fusion
        return "tanh" if self.activation == "gelu" and self.add_bias_linear and fused else "none"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            check_positive(name, getattr(self, name))
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        if self.fp16 and self.bf16:
            raise ConfigError(
                "fp16 and bf16 cannot be used together; pick one (bf16 is preferred on Ampere+)",
                params=("fp16", "bf16"),
            )
        if self.fp16:
            self.params_dtype = torch.float16
        elif self.bf16:
            self.params_dtype = torch.bfloat16
        super().__post_init__()
        check_refused(self, config_support.TC_REFUSED)
        swiglu_flag_default_ffn = config_aliases.sync_activation(self)
        if self.bias_activation_fusion and self.activation == "gelu" and not self.add_bias_linear:
            raise ConfigError(
                "bias_activation_fusion=True with a GELU MLP needs add_bias_linear=True (it fuses the "
                "bias into the GELU); set bias_activation_fusion=False"
            )
        config_aliases.sync_megatron_names(self)
        config_checks.derive_shapes(self, swiglu_flag_default_ffn)
        check_positive("init_method_std", self.init_method_std)
        config_support.derive_init_methods(self)
        check_positive(
            "rotary_seq_len_interpolation_factor", self.rotary_seq_len_interpolation_factor, allow_none=True
        )
        self.apply_layernorm_1p = self.layernorm_zero_centered_gamma = (
            self.apply_layernorm_1p or self.layernorm_zero_centered_gamma
        )
        if self.pipeline_dtype is not None and self.pipeline_dtype != self.params_dtype:
            raise ConfigError(
                f"pipeline_dtype {self.pipeline_dtype} differs from the parameter dtype {self.params_dtype}: "
                "activations travel between pipeline stages in the parameter dtype here; pass "
                f"pipeline_dtype={self.params_dtype} or leave it unset",
                params=("pipeline_dtype",),
            )
        config_checks.check_fp8(self)
        config_checks.check_parallelism(self)
        config_checks.check_moe(self)

    def check_parallel_sizes(self, tp_size: int, pp_size: int, cp_size: int = 1) -> None:
        """Check this config against the process groups a model is built on (``tp_size`` x ``pp_size``
        x ``cp_size``).

        The groups decide (Megatron-Core's layers read parallel_state too): a size left at its default 1
        follows them, any other value must equal theirs. The split rules are checked for the groups' sizes.

        Raises:
            ConfigError: a size that disagrees with the groups (naming both), or a tp size of the groups
                that does not divide the heads, query groups or FFN channels.
        """
        for name, given, actual in (
            ("tensor_model_parallel_size", self.tensor_model_parallel_size, tp_size),
            ("pipeline_model_parallel_size", self.pipeline_model_parallel_size, pp_size),
            ("context_parallel_size", self.context_parallel_size, cp_size),
        ):
            if given not in (1, actual):
                follow = "" if actual == 1 else " or leave it at 1 to follow the groups"
                raise ConfigError(
                    f"TransformerConfig.{name} is {given} but the model is built on process groups of "
                    f"size {actual} (initialize_model_parallel / the ParallelState passed in); set it to "
                    f"{actual}{follow}",
                    params=(name,),
                )
        config_checks.check_tp_divides(self, tp_size)

    def pipeline_layout(self, pp: int | None = None, vpp: int | None = None) -> PipelineLayout:
        """Layer counts per virtual stage for ``pp`` ranks x ``vpp`` chunks (default: this config's)."""
        return build_pipeline_layout(
            self.num_layers,
            self.pipeline_model_parallel_size if pp is None else pp,
            self.virtual_pipeline_model_parallel_size if vpp is None else vpp,
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
            self.pipeline_model_parallel_layout,
            self.account_for_embedding_in_pipeline_split,
            self.account_for_loss_in_pipeline_split,
        )

    @property
    def rotary_dim(self) -> int:
        """Channels per head rotated by RoPE."""
        assert self.kv_channels is not None  # filled in by __post_init__
        return int(self.kv_channels * self.rotary_percent)

    @property
    def output_layer_init_std(self) -> float:
        """Std for projections that write into the residual stream (GPT-2 / Megatron scaled init)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Megatron-Core's config of multi-latent attention, which is not built here: constructing one is
    refused (``multi_latent_attention=True``), naming the field. Its fields exist with Megatron-Core's
    defaults so that the refusal, not a TypeError, is what a user sees."""

    multi_latent_attention: bool = doc(True, flag=None)
    q_lora_rank: int = doc(512, flag=None)
    kv_lora_rank: int = doc(512, flag=None)
    qk_head_dim: int = doc(128, flag=None)
    qk_pos_emb_head_dim: int = doc(64, flag=None)
    v_head_dim: int = doc(128, flag=None)
    normalization: str = doc("RMSNorm", flag=None)
    rope_type: str = doc("yarn", flag=None)
    rotary_base: int = doc(10000, flag=None)
    rotary_percent: float = doc(1.0, flag=None)
    rotary_scaling_factor: float = doc(40, flag=None)
    original_max_position_embeddings: int = doc(4096, flag=None)
    beta_fast: float = doc(32, flag=None)
    beta_slow: float = doc(1, flag=None)
    mscale: float = doc(1.0, flag=None)
    mscale_all_dim: float = doc(0.0, flag=None)
    cache_mla_latents: bool = doc(False, flag=None)
    mla_down_proj_fusion: bool = doc(False, flag=None)


__all__ = ["TransformerConfig", "MLATransformerConfig"]
