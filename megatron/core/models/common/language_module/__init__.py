"""Megatron-Core's base class of language models."""

from megatron.core.models.common.language_module.language_module import LanguageModule

__all__ = ["LanguageModule"]
