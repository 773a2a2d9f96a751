"""The tokenizer of metadata ``model_type`` "t5"."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class T5Tokenizer(MegatronTokenizerText):
    """A ``MegatronTokenizerText``; the model type changes nothing else here."""
