"""The tokenizer of metadata ``model_type`` "bert"."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class BertTokenizer(MegatronTokenizerText):
    """A ``MegatronTokenizerText``; the model type changes nothing else here."""
