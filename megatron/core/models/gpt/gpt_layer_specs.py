"""Layer specs for GPTModel built from this package's own (local) modules, with Megatron-Core's
function names and signatures.

Every spec here builds the same local layer: pre-norms, SDPA self-attention (causal) and a dense
MLP, or with experts (``num_experts``) an ``MoELayer`` in the MLP's slot (router, token dispatcher,
grouped experts, shared experts). Which norm (``config.normalization``) and which activation
(``config.activation``) run is the config's, as with Megatron-Core's local modules; ``use_te=True`` /
``use_transformer_engine=True`` build the local layer too (Transformer Engine is not used here: the
same function, this package's kernels). The decoder block specs put the MoE layer on the layers that
``config.moe_layer_freq`` marks (``moe_config_fields.moe_layer_pattern``) and the dense MLP on the
others. What is not built (multi-latent attention, QK L2 norm, Kitchen) is refused.

:func:`get_gpt_layer_plan_spec` and :func:`get_gpt_decoder_block_plan_spec` build the same layer with
the implementations an ``ExecutionPlan`` chose: each linear's GEMM (``fp8_gemm``), the activation
(``MLPSubmodules.activation_func``), the MLP class (:class:`~megatron.core.transformer.mlp.
Fp8SwigluMLP` for the FP8 SwiGLU block, ``MoELayer`` on ``plan.moe_layers``) and the core attention
(``ContextParallelAttention``). A new variant enters here: a class in a slot, chosen from the plan.
"""

from __future__ import annotations

from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.execution_plan import ExecutionPlan, Fp8GemmBuilder
from megatron.core.fusions.fp8 import AmaxReducer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.context_parallel.attention import ContextParallelAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, Fp8SwigluMLP, MLPSubmodules, swiglu_triton_backward
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe_config_fields import moe_layer_pattern
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _refuse(function: str, **asked: Any) -> None:
    what = {
        "multi_latent_attention": "multi-latent attention is not built; leave it False",
        "qk_l2_norm": "query/key L2 norm is not built; use qk_layernorm=True or leave it False",
        "use_kitchen": "NVIDIA Kitchen is not used; leave it False",
        "use_kitchen_attention": "NVIDIA Kitchen is not used; leave it False",
    }
    for name, value in asked.items():
        if value not in (None, False):
            raise ConfigError(f"{function}({name}={value!r}) is not supported here: {what[name]}")


def get_gpt_layer_local_submodules(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> TransformerLayerSubmodules:
    """The submodules of the local decoder layer.

    Args:
        num_experts: an ``MoELayer`` in the MLP's slot (its size and routing are the config's
            ``num_moe_experts`` and ``moe_*`` fields); None: the dense MLP.
        moe_grouped_gemm: accepted; whether the experts run one grouped GEMM is the config's
            ``moe_grouped_gemm`` (the same ``GroupedExperts`` module either way).
        qk_layernorm: build query/key norms even when ``config.qk_layernorm`` is False (either one
            turns them on).
        fp8: deprecated in Megatron-Core; ignored (FP8 is the config's ``fp8``).
        normalization: accepted; the norm is ``config.normalization``'s.
        multi_latent_attention, qk_l2_norm, use_kitchen, use_kitchen_attention: must be left at
            their defaults (not built here).

    Raises:
        ConfigError: one of the refused arguments set, naming it.
    """
    _refuse(
        "get_gpt_layer_local_submodules",
        multi_latent_attention=multi_latent_attention,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
    )
    qk_norm = ModuleSpec(module=Norm, metainfo={"qk_layernorm": True}) if qk_layernorm else Norm
    return TransformerLayerSubmodules(
        input_layernorm=Norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        ),
        pre_mlp_layernorm=Norm,
        mlp=get_mlp_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm),
    )


def get_gpt_layer_local_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """The local decoder layer's spec: ``ModuleSpec(TransformerLayer, submodules=
    get_gpt_layer_local_submodules(...))`` (same arguments)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=get_gpt_layer_local_submodules(
            num_experts,
            moe_grouped_gemm,
            qk_layernorm,
            multi_latent_attention,
            fp8,
            normalization,
            qk_l2_norm,
            use_kitchen,
            use_kitchen_attention,
            kitchen_attention_backend,
        ),
    )


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    **kwargs: Any,
) -> ModuleSpec:
    """Megatron-Core's Transformer Engine layer spec. Transformer Engine is not used here: this is the
    local layer (:func:`get_gpt_layer_local_spec`), the same function with this package's kernels;
    the Transformer Engine-only keywords are accepted and have no effect."""
    return get_gpt_layer_local_spec(
        num_experts,
        moe_grouped_gemm,
        qk_layernorm,
        multi_latent_attention,
        fp8,
        qk_l2_norm=kwargs.get("qk_l2_norm", False),
        use_kitchen=kwargs.get("use_kitchen", False),
    )


def get_mlp_module_spec(
    use_te: bool | None = True,
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    fp8: str | None = None,
    use_te_op_fuser: bool | None = False,
) -> ModuleSpec:
    """The dense MLP's spec, ``ModuleSpec(MLP, submodules=MLPSubmodules(ColumnParallelLinear,
    RowParallelLinear))``, or with ``num_experts`` the MoE layer's, ``ModuleSpec(MoELayer,
    submodules=MoESubmodules(GroupedExperts, SharedExpertMLP))`` (shared experts built when the
    config has ``moe_shared_expert_intermediate_size``; ``moe_grouped_gemm`` is the config's, see
    :func:`get_gpt_layer_local_submodules`). ``use_te=True`` (the default) and ``use_te_op_fuser``
    build the same local modules (no Transformer Engine here); ``fp8`` is ignored."""
    if num_experts:
        return ModuleSpec(
            module=MoELayer,
            submodules=MoESubmodules(experts=GroupedExperts, shared_experts=SharedExpertMLP),
        )
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def get_gpt_decoder_block_spec(
    config: Any,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block's spec: one local layer spec for each of ``config.num_layers`` layers (layer
    ``i``'s at index ``i``; GPTModel builds its stage's layers) and the final norm. With
    ``config.num_moe_experts`` the layers ``config.moe_layer_freq`` marks hold an ``MoELayer`` and
    the others the dense MLP.

    Raises:
        ConfigError: ``qk_l2_norm`` set.
    """
    experts = getattr(config, "num_moe_experts", None)
    common: dict[str, Any] = dict(
        qk_layernorm=getattr(config, "qk_layernorm", False),
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
    )
    moe = get_gpt_layer_local_spec(num_experts=experts, **common)
    if not experts:
        return TransformerBlockSubmodules(layer_specs=[moe] * config.num_layers, layer_norm=Norm)
    dense = get_gpt_layer_local_spec(**common)
    specs = [moe if is_moe else dense for is_moe in moe_layer_pattern(config)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=Norm)


def _linear(
    cls: type, name: str, layer_number: int, plan: ExecutionPlan, builder: Fp8GemmBuilder | None
) -> Any:
    """``cls``, or its spec with the FP8 GEMM builder where the plan runs ``name`` of this layer in FP8."""
    if builder is None or plan.fp8 is None or not plan.fp8.runs(layer_number, name):
        return cls
    return ModuleSpec(module=cls, params={"fp8_gemm": builder})


def get_gpt_layer_plan_spec(
    plan: ExecutionPlan, layer_number: int, amax_reducer: AmaxReducer | None = None
) -> ModuleSpec:
    """The local decoder layer (:func:`get_gpt_layer_local_spec`) of global 1-based ``layer_number``
    with ``plan``'s implementations. ``amax_reducer``: delayed FP8 scaling's amax reduction across
    ranks (the trainer's; None: each rank keeps its own amaxes)."""
    builder = plan.fp8_gemm_builder(amax_reducer)
    submodules = get_gpt_layer_local_submodules()
    attn = submodules.self_attention.submodules
    if plan.attention == "context_parallel":
        attn.core_attention = ContextParallelAttention
    attn.linear_qkv = _linear(ColumnParallelLinear, "linear_qkv", layer_number, plan, builder)
    attn.linear_proj = _linear(RowParallelLinear, "linear_proj", layer_number, plan, builder)
    if layer_number in plan.moe_layers:
        submodules.mlp = get_mlp_module_spec(num_experts=plan.config.num_moe_experts)
        submodules.mlp.params["compile_helpers"] = plan.compile_helpers
        return ModuleSpec(module=TransformerLayer, submodules=submodules)
    swiglu = plan.config.activation == "swiglu"
    activation = swiglu_triton_backward if swiglu and plan.swiglu == "triton" else None
    block = plan.fp8 is not None and plan.fp8.swiglu_block and layer_number in plan.fp8.layers
    submodules.mlp = ModuleSpec(
        module=Fp8SwigluMLP if block else MLP,
        submodules=MLPSubmodules(
            linear_fc1=_linear(ColumnParallelLinear, "linear_fc1", layer_number, plan, builder),
            linear_fc2=_linear(RowParallelLinear, "linear_fc2", layer_number, plan, builder),
            activation_func=activation,
        ),
    )
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def get_gpt_decoder_block_plan_spec(
    plan: ExecutionPlan, amax_reducer: AmaxReducer | None = None
) -> TransformerBlockSubmodules:
    """One :func:`get_gpt_layer_plan_spec` per layer of the model (``plan.config.num_layers``; layers
    the plan treats alike share one spec) and the final norm; GPTModel builds its stage's layers."""
    fp8_layers = plan.fp8.layers if plan.fp8 is not None else frozenset()
    shared: dict[tuple[bool, bool], ModuleSpec] = {}
    specs = []
    for number in range(1, plan.config.num_layers + 1):
        kind = (number in fp8_layers, number in plan.moe_layers)
        if kind not in shared:
            shared[kind] = get_gpt_layer_plan_spec(plan, number, amax_reducer)
        specs.append(shared[kind])
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=Norm)
