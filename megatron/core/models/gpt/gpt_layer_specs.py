"""Layer specs for GPTModel built from this package's own (local) modules."""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_gpt_layer_local_spec(qk_layernorm: bool = False, **_ignored) -> ModuleSpec:
    """The decoder layer: pre-norms, SDPA self-attention and an MLP, all from local modules.

    ``qk_layernorm`` is accepted for Megatron-Core compatibility; whether query/key norms are used is
    decided by ``TransformerConfig.qk_layernorm``.
    """
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=Norm,
                    k_layernorm=Norm,
                ),
            ),
            pre_mlp_layernorm=Norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
        ),
    )
