"""Megatron-Core's ``megatron.core.tokenizers`` package: ``MegatronTokenizer.from_pretrained`` and
``build_tokenizer`` over the tokenizer classes of ``megatron.core.tokenizer``."""

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer

__all__ = ["MegatronTokenizer", "MegatronTokenizerBase"]
