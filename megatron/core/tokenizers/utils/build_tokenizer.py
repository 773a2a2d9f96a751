"""``build_tokenizer(args)``: the tokenizer that Megatron's ``--tokenizer-type`` flags describe,
restored through ``MegatronTokenizer.from_pretrained`` as Megatron-Core 0.19.2 does."""

from __future__ import annotations

import logging
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizer import vocab_size_with_padding as _pad_vocab
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer

MEGATRON_TOKENIZERS = ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"]
SP_TOKENIZERS = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
SUPPORTED_TOKENIZERS = [
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
    *MEGATRON_TOKENIZERS,
    *SP_TOKENIZERS,
]

logger = logging.getLogger(__name__)


def _library_path_options(args: Any) -> tuple[str, str | None, dict[str, Any]]:
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    kind = args.tokenizer_type
    hf_options = {
        "additional_special_tokens": get("special_tokens") or [],
        "use_fast": not get("tokenizer_hf_no_use_fast", False),
        "trust_remote_code": get("trust_remote_code", False),
        "include_special_tokens": not get("tokenizer_hf_no_include_special_tokens", False),
    }
    if kind in MEGATRON_TOKENIZERS:
        return (
            "megatron",
            kind,
            {**hf_options, "vocab_file": get("vocab_file"), "merges_file": get("merge_file")},
        )
    if kind in SP_TOKENIZERS:
        return (
            "sentencepiece",
            get("tokenizer_model"),
            {
                "chat_template": get("chat_template"),
                "ignore_extra_whitespaces": get("tokenizer_sentencepiece_ignore_extra_whitespaces", True),
                "legacy": get("tokenizer_sentencepiece_legacy", False),
                "special_tokens": get("special_tokens"),
            },
        )
    if kind == "TikTokenizer":
        options = {
            "chat_template": get("chat_template"),
            "num_special_tokens": get("tiktoken_num_special_tokens", 1000),
            "special_tokens": get("special_tokens"),
        }
        if get("tiktoken_pattern"):
            options["pattern"] = get("tiktoken_pattern")
        if get("vocab_size"):
            options["vocab_size"] = get("vocab_size")
        return "tiktoken", get("tokenizer_model"), options
    if kind == "HuggingFaceTokenizer":
        return (
            "huggingface",
            get("tokenizer_model"),
            {
                **hf_options,
                "chat_template": get("chat_template"),
                "vocab_file": get("vocab_file"),
                "merges_file": get("merge_file"),
            },
        )
    if kind == "NullTokenizer":
        options = {"vocab_size": get("vocab_size")} if get("vocab_size") else {}
        for flag, name in (("null_tokenizer_eod_id", "eod_id"), ("null_tokenizer_pad_id", "pad_id")):
            if get(flag) is not None:
                options[name] = get(flag)
        return "null-text", None, options
    library = {
        "MultimodalTokenizer": "multimodal",
        "NullMultimodalTokenizer": "null-multimodal",
        "SFTTokenizer": "sft",
    }[kind]
    return library, get("tokenizer_model"), {}


def build_tokenizer(args: Any, **kwargs: Any) -> MegatronTokenizerBase:
    """The tokenizer of ``args.tokenizer_type`` and its file flags (``tokenizer_model``,
    ``vocab_file``, ``merge_file``, ``vocab_size`` ...); ``args.metadata_path``, when set, replaces
    the metadata. With ``args.pad_vocab_size`` true, sets ``args.padded_vocab_size`` if it is None.

    Raises:
        ValueError: an unknown ``tokenizer_type`` (the valid ones are listed), or what
            ``MegatronTokenizer.from_pretrained`` refuses.
    """
    if getattr(args, "tokenizer_type", None) not in SUPPORTED_TOKENIZERS:
        raise ConfigError(
            f"tokenizer_type {getattr(args, 'tokenizer_type', None)!r} is not supported; choose one of "
            f"{SUPPORTED_TOKENIZERS}"
        )
    library, path, options = _library_path_options(args)
    metadata = getattr(args, "metadata_path", None) if library != "null-text" else None
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path=metadata or {"library": library}, **options
    )
    if getattr(args, "pad_vocab_size", False) and getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args: Any, logging_enabled: bool = True) -> int:
    """``orig_vocab_size`` rounded up to a multiple of ``args.make_vocab_size_divisible_by *
    args.tensor_model_parallel_size`` (logged on rank 0 when ``logging_enabled``)."""
    log = logger.info if logging_enabled and getattr(args, "rank", 0) == 0 else None
    return _pad_vocab(
        orig_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size, log
    )
