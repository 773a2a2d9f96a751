"""GPT-2 byte-level BPE from a local ``vocab.json`` + ``merges.txt`` (Hugging Face ``tokenizers``)."""

from __future__ import annotations

import json
from typing import Any

from megatron.core.datasets.errors import DataError
from megatron.core.tokenizer.base import FastTokenizer, require_file

EOD_TOKEN = "<|endoftext|>"


def load_byte_level_bpe(vocab_file: str, merge_file: str) -> Any:
    """A ``tokenizers.Tokenizer`` with GPT-2's byte-level pre-tokenizer, BPE model and decoder.

    ``<|endoftext|>`` is not registered as a special token: like GPT-2's reference encoder,
    the literal string in text is encoded as ordinary characters.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as exc:  # the Rust error says what is wrong but not which flag to fix
        raise DataError(
            f"could not read vocab_file {vocab_file!r} / merge_file {merge_file!r} as GPT-2 BPE: {exc}",
            params=("vocab_file", "merge_file"),
        ) from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class GPT2BPETokenizer(FastTokenizer):
    """Byte-level BPE (GPT-2). eod is ``<|endoftext|>`` (50256 for the original GPT-2 files).

    Args:
        vocab_file: ``--vocab-file`` (vocab.json, token -> id).
        merge_file: ``--merge-file`` (merges.txt).

    Raises:
        ValueError: a file is missing or unreadable, or the vocabulary has no ``<|endoftext|>``.
    """

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        vocab_file = require_file(vocab_file, "vocab_file", "GPT2BPETokenizer")
        merge_file = require_file(merge_file, "merge_file", "GPT2BPETokenizer")
        super().__init__(vocab_file, merge_file)
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(
                f"vocab_file {vocab_file!r} is not a JSON vocabulary: {exc}", params=("vocab_file",)
            ) from None
        if EOD_TOKEN not in vocab:
            raise DataError(
                f"vocab_file {vocab_file!r} has no {EOD_TOKEN} token (the end-of-document id)",
                params=("vocab_file",),
            )
        self._eod = int(vocab[EOD_TOKEN])
        self._vocab_size = len(vocab)
        self._tok = load_byte_level_bpe(vocab_file, merge_file)
