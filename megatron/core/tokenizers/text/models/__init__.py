"""The model types of a tokenizer's metadata (``model_type``), at Megatron-Core's module paths."""

from megatron.core.tokenizers.text.models.bert_tokenizer import BertTokenizer
from megatron.core.tokenizers.text.models.default_tokenizer import DefaultTokenizerText
from megatron.core.tokenizers.text.models.gpt_tokenizer import GPTTokenizer
from megatron.core.tokenizers.text.models.mamba_tokenizer import MambaTokenizer
from megatron.core.tokenizers.text.models.t5_tokenizer import T5Tokenizer
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

MODEL_TYPES: dict[str, type[MegatronTokenizerText]] = {
    "default-text": DefaultTokenizerText,
    "gpt": GPTTokenizer,
    "mamba": MambaTokenizer,
    "bert": BertTokenizer,
    "t5": T5Tokenizer,
}

__all__ = [
    "MODEL_TYPES",
    "BertTokenizer",
    "DefaultTokenizerText",
    "GPTTokenizer",
    "MambaTokenizer",
    "T5Tokenizer",
]
