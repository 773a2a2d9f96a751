"""Megatron-Core's module path of the core attention: ``DotProductAttention`` is the one in
:mod:`megatron.core.transformer.attention` (SDPA), so a spec written against either path builds it."""

from megatron.core.transformer.attention import DotProductAttention

__all__ = ["DotProductAttention"]
