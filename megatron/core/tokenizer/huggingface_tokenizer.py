"""HuggingFaceTokenizer from a local ``tokenizer.json`` (or a directory holding one)."""

from __future__ import annotations

import json
import os

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.errors import DataError
from megatron.core.tokenizer.base import FastTokenizer

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _eos_from_config(directory: str) -> str | None:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


class HuggingFaceTokenizer(FastTokenizer):
    """A fast tokenizer read with the ``tokenizers`` library (no ``transformers``, no hub access).

    eod is the eos token named by ``tokenizer_config.json`` next to the file, else the first of
    ``</s>, <|endoftext|>, <|end_of_text|>, <eos>, <|eot_id|>`` in the vocabulary.

    Args:
        path: ``--tokenizer-model``, a ``tokenizer.json`` file or a directory containing one.

    Raises:
        ValueError: the path is missing, unreadable, or no eos token can be found.
    """

    def __init__(self, path: str | None) -> None:
        from tokenizers import Tokenizer

        if not path:
            raise ConfigError(
                "tokenizer_model is required for HuggingFaceTokenizer (a tokenizer.json or dir)",
                params=("tokenizer_model",),
            )
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(
                f"tokenizer_model {path!r}: {file!r} does not exist (give a local tokenizer.json or a "
                "directory holding one; nothing is downloaded)",
                params=("tokenizer_model",),
            )
        super().__init__(file)
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:
            raise DataError(
                f"tokenizer_model {file!r} is not a tokenizers JSON file: {exc}", params=("tokenizer_model",)
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = _eos_from_config(os.path.dirname(os.path.abspath(file)))
        names = [eos] if eos else [n for n in EOS_CANDIDATES if n in vocab]
        if not names or names[0] not in vocab:
            raise DataError(
                f"tokenizer_model {file!r}: no end-of-document token found (tried {names or EOS_CANDIDATES})",
                params=("tokenizer_model",),
            )
        self._eod = int(vocab[names[0]])
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        pad = next((vocab[n] for n in ("<pad>", "[PAD]", "<|pad|>") if n in vocab), -1)
        self._pad = int(pad)
