"""Text tokenizers returned by ``MegatronTokenizer.from_pretrained``."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

__all__ = ["MegatronTokenizerText"]
