"""Megatron-Core's ``MLATransformerConfig`` (defined with ``TransformerConfig``, whose module is where
Megatron-Core users import it from): multi-latent attention is not built here, so constructing one is
refused, naming the field."""

from megatron.core.transformer.transformer_config import MLATransformerConfig

__all__ = ["MLATransformerConfig"]
