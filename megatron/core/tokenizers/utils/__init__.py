"""Megatron-Core's ``megatron.core.tokenizers.utils``."""
