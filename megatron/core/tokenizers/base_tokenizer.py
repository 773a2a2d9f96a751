"""``MegatronTokenizerBase``: Megatron-Core's name for the tokenizer interface the data path uses.

It is ``megatron.core.tokenizer.base.MegatronTokenizer`` itself, so every tokenizer of this project
(and every one ``MegatronTokenizer.from_pretrained`` returns) is an instance of it.
"""

from megatron.core.tokenizer.base import MegatronTokenizer as MegatronTokenizerBase

__all__ = ["MegatronTokenizerBase"]
