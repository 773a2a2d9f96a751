"""The tokenizer of metadata ``model_type`` absent or "default-text"."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class DefaultTokenizerText(MegatronTokenizerText):
    """A ``MegatronTokenizerText``; the model type changes nothing else here."""
