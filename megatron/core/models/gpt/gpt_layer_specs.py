"""Layer specs for GPTModel built from this package's own (local) modules, with Megatron-Core's
function names and signatures.

Every spec here builds the same local layer: pre-norms, SDPA self-attention (causal) and a dense
MLP. Which norm (``config.normalization``) and which activation (``config.activation``) run is the
config's, as with Megatron-Core's local modules; ``use_te=True`` / ``use_transformer_engine=True``
build the local layer too (Transformer Engine is not used here: the same function, this package's
kernels). What is not built (experts, multi-latent attention, QK L2 norm, Kitchen) is refused.
"""

from __future__ import annotations

from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _refuse(function: str, **asked: Any) -> None:
    what = {"num_experts": "experts (MoE) are not built yet (issue 28); leave it None",
            "moe_grouped_gemm": "only with experts, which are not built yet (issue 28); leave it False",
            "multi_latent_attention": "multi-latent attention is not built; leave it False",
            "qk_l2_norm": "query/key L2 norm is not built; use qk_layernorm=True or leave it False",
            "use_kitchen": "NVIDIA Kitchen is not used; leave it False",
            "use_kitchen_attention": "NVIDIA Kitchen is not used; leave it False"}
    for name, value in asked.items():
        if value not in (None, False):
            raise ConfigError(f"{function}({name}={value!r}) is not supported here: {what[name]}")


def get_gpt_layer_local_submodules(
    num_experts: int | None = None, moe_grouped_gemm: bool | None = False, qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False, fp8: str | None = None, normalization: str | None = None,
    qk_l2_norm: bool | None = False, use_kitchen: bool = False, use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> TransformerLayerSubmodules:
    """The submodules of the local decoder layer.

    Args:
        qk_layernorm: build query/key norms even when ``config.qk_layernorm`` is False (either one
            turns them on).
        fp8: deprecated in Megatron-Core; ignored (FP8 is the config's ``fp8``).
        normalization: accepted; the norm is ``config.normalization``'s.
        num_experts, moe_grouped_gemm, multi_latent_attention, qk_l2_norm, use_kitchen,
            use_kitchen_attention: must be left at their defaults (not built here).

    Raises:
        ConfigError: one of the refused arguments set, naming it.
    """
    _refuse("get_gpt_layer_local_submodules", num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
            multi_latent_attention=multi_latent_attention, qk_l2_norm=qk_l2_norm, use_kitchen=use_kitchen,
            use_kitchen_attention=use_kitchen_attention)
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
        mlp=get_mlp_module_spec(use_te=False),
    )


def get_gpt_layer_local_spec(
    num_experts: int | None = None, moe_grouped_gemm: bool | None = False, qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False, fp8: str | None = None, normalization: str | None = None,
    qk_l2_norm: bool | None = False, use_kitchen: bool = False, use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """The local decoder layer's spec: ``ModuleSpec(TransformerLayer, submodules=
    get_gpt_layer_local_submodules(...))`` (same arguments)."""
    return ModuleSpec(module=TransformerLayer, submodules=get_gpt_layer_local_submodules(
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8, normalization, qk_l2_norm,
        use_kitchen, use_kitchen_attention, kitchen_attention_backend))


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int | None = None, moe_grouped_gemm: bool | None = False, qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False, fp8: str | None = None, **kwargs: Any,
) -> ModuleSpec:
    """Megatron-Core's Transformer Engine layer spec. Transformer Engine is not used here: this is the
    local layer (:func:`get_gpt_layer_local_spec`), the same function with this package's kernels;
    the Transformer Engine-only keywords are accepted and have no effect."""
    return get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
                                    qk_l2_norm=kwargs.get("qk_l2_norm", False),
                                    use_kitchen=kwargs.get("use_kitchen", False))


def get_mlp_module_spec(use_te: bool | None = True, num_experts: int | None = None,
                        moe_grouped_gemm: bool | None = False, fp8: str | None = None,
                        use_te_op_fuser: bool | None = False) -> ModuleSpec:
    """The dense MLP's spec, ``ModuleSpec(MLP, submodules=MLPSubmodules(ColumnParallelLinear,
    RowParallelLinear))``. ``use_te=True`` (the default) and ``use_te_op_fuser`` build the same local MLP
    (no Transformer Engine here); ``fp8`` is ignored.

    Raises:
        ConfigError: ``num_experts`` or ``moe_grouped_gemm`` set (experts are not built yet).
    """
    _refuse("get_mlp_module_spec", num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def get_gpt_decoder_block_spec(config: Any, use_transformer_engine: bool, normalization: str | None = None,
                               qk_l2_norm: bool | None = False, vp_stage: int | None = None,
                               pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block's spec: one local layer spec for each of ``config.num_layers`` layers (every
    layer is the same here, so the pipeline stage's slice is any ``num_layers`` of them; GPTModel
    builds its stage's layers) and the final norm.

    Raises:
        ConfigError: ``config.num_moe_experts`` or ``qk_l2_norm`` set.
    """
    layer = get_gpt_layer_local_spec(num_experts=getattr(config, "num_moe_experts", None),
                                     qk_layernorm=getattr(config, "qk_layernorm", False),
                                     normalization=normalization, qk_l2_norm=qk_l2_norm)
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=Norm)
