"""The tokenizer of metadata ``model_type`` "gpt"."""

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class GPTTokenizer(MegatronTokenizerText):
    """A ``MegatronTokenizerText``; the model type changes nothing else here."""
