"""Megatron-Core's module path of the PyTorch norms. ``WrappedTorchNorm`` (and ``LNImpl``) name our
:class:`~megatron.core.transformer.norms.Norm`: LayerNorm or RMSNorm as ``config.normalization`` says,
with zero-centred gamma and sequence parallelism supported (Megatron-Core's wrapper refuses both)."""

from megatron.core.transformer.norms import Norm

WrappedTorchNorm = Norm
LNImpl = Norm

__all__ = ["LNImpl", "WrappedTorchNorm"]
