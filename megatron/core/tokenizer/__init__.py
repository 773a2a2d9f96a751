"""Tokenizers selected by ``--tokenizer-type``, and vocabulary padding.

All files are local; nothing is downloaded. ``build_tokenizer`` raises ``ValueError`` naming the
flag or file for every user error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizer import sentencepiece_tokenizer
from megatron.core.tokenizer.base import MegatronTokenizer
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizer.null import NullTokenizer
from megatron.core.tokenizer.tiktoken_tokenizer import TikTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)

__all__ = [
    "MegatronTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "vocab_size_with_padding",
]


def build_tokenizer(cfg: Any) -> MegatronTokenizer:
    """Build the tokenizer a ``TokenizerConfig`` (or any object with its fields) describes.

    Args:
        cfg: has ``tokenizer_type`` and the file/size fields of that type.

    Returns:
        a ``MegatronTokenizer`` with ``vocab_size`` (unpadded), ``eod``, ``pad``,
        ``tokenize``/``detokenize`` and ``unique_identifiers``.

    Raises:
        ValueError: unknown type, or a required flag/file is missing or invalid.
    """
    kind = getattr(cfg, "tokenizer_type", None)
    get = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    if kind == "NullTokenizer":
        return NullTokenizer(
            get("vocab_size"), get("null_tokenizer_eod_id"), get("null_tokenizer_pad_id", -1)
        )
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(get("vocab_file"), get("merge_file"))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return getattr(sentencepiece_tokenizer, kind)(get("tokenizer_model"))
    if kind == "TikTokenizer":
        return TikTokenizer(
            get("tokenizer_model"),
            get("tiktoken_pattern", "v2"),
            get("vocab_size"),
            get("tiktoken_num_special_tokens", 1000),
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(get("tokenizer_model"))
    raise ConfigError(
        f"tokenizer_type {kind!r} is not valid; choose one of {list(TOKENIZER_TYPES)}",
        params=("tokenizer_type",),
    )


def vocab_size_with_padding(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int,
    tp_size: int,
    log: Callable[[str], Any] | None = print,
) -> int:
    """Round the vocabulary up to a multiple of ``make_vocab_size_divisible_by * tp_size``.

    Prints `` > padded vocab (size: V) with K dummy tokens (new size: P)`` through ``log``.

    Raises:
        ValueError: a non-positive multiple or tensor-parallel size.
    """
    if make_vocab_size_divisible_by < 1:
        raise ConfigError(
            f"make_vocab_size_divisible_by must be >= 1, got {make_vocab_size_divisible_by}",
            params=("make_vocab_size_divisible_by",),
        )
    if tp_size < 1:
        raise ConfigError(
            f"tensor_model_parallel_size must be >= 1, got {tp_size}", params=("tensor_model_parallel_size",)
        )
    multiple = make_vocab_size_divisible_by * tp_size
    padded = -(-int(orig_vocab_size) // multiple) * multiple
    if log is not None:
        log(
            f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
            f"(new size: {padded})"
        )
    return padded
