"""The tokenizer of metadata ``model_type`` "mamba"."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class MambaTokenizer(MegatronTokenizerText):
    """A ``MegatronTokenizerText``; the model type changes nothing else here."""
