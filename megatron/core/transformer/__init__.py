"""The transformer building blocks, with Megatron-Core's package-level names."""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "MegatronModule",
    "ModuleSpec",
    "build_module",
    "MLATransformerConfig",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
]
