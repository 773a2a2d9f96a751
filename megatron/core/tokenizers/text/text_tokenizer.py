"""MegatronTokenizerText: Megatron-Core's text tokenizer object over one of our tokenizer classes.

Each metadata ``library`` maps onto one class of ``megatron.core.tokenizer`` (the only
implementation of it); this object adds Megatron-Core's names around it (``library``, ``path``,
``additional_args``, ``*_id`` aliases, ``vocab_file`` ...).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizer.base import MegatronTokenizer
from megatron.core.tokenizer.byte_level import ByteLevelTokenizer
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizer.null import NullTokenizer
from megatron.core.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.core.tokenizer.tiktoken_tokenizer import TikTokenizer

ANY = object()
"""Marks an option accepted with any value (it changes nothing here)."""

_HF_OPTIONS: dict[str, Any] = {
    "additional_special_tokens": (None, []),
    "use_fast": ANY,
    "trust_remote_code": ANY,
    "include_special_tokens": ANY,
    "chat_template": ANY,
    "mask_token": (None,),
    "bos_token": (None,),
    "eos_token": (None,),
    "pad_token": (None,),
    "sep_token": (None,),
    "cls_token": (None,),
    "unk_token": (None,),
}

# Per library: the options accepted and the values that leave our class's ids unchanged.
OPTIONS: dict[str, dict[str, Any]] = {
    "null-text": {"vocab_size": ANY, "eod_id": ANY, "pad_id": ANY, "chat_template": ANY},
    "sentencepiece": {
        "special_tokens": (None, [], {}),
        "legacy": (False,),
        "ignore_extra_whitespaces": (True,),
        "trim_spm_separator_after_special_token": ANY,
        "spm_separator": ("\u2581",),
        "chat_template": ANY,
    },
    "huggingface": {**_HF_OPTIONS, "vocab_file": (None,), "merges_file": (None,)},
    "megatron": {**_HF_OPTIONS, "vocab_file": ANY, "merges_file": ANY},
    "byte-level": {
        "special_tokens": ANY,
        "vocab_size": ANY,
        "_eos_id": ANY,
        "_pad_id": ANY,
        "_bos_id": ANY,
        "chat_template": ANY,
    },
    "tiktoken": {
        "pattern": ANY,
        "vocab_size": ANY,
        "num_special_tokens": ANY,
        "special_tokens": (None,),
        "chat_template": ANY,
    },
}

REFUSED_LIBRARIES = {
    "sft": "the SFT tokenizer (prompt formats) is not provided",
    "multimodal": "vision/multimodal tokenizers are not provided",
    "null-multimodal": "vision/multimodal tokenizers are not provided",
}


def _null(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    if kw.get("vocab_size") is None:
        raise ConfigError(
            "library 'null-text' needs vocab_size=..., e.g. from_pretrained(metadata_path="
            "{'library': 'null-text'}, vocab_size=32000)"
        )
    return NullTokenizer(kw["vocab_size"], kw.get("eod_id"), kw.get("pad_id", -1))


def _sentencepiece(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    return SentencePieceTokenizer(path)


def _huggingface(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    return HuggingFaceTokenizer(path)


def _megatron(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    if path != "GPT2BPETokenizer":
        raise ConfigError(
            f"library 'megatron': tokenizer_path {path!r} is not provided; use 'GPT2BPETokenizer' "
            "with vocab_file= and merges_file="
        )
    return GPT2BPETokenizer(kw.get("vocab_file"), kw.get("merges_file"))


def _tiktoken(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    return TikTokenizer(
        path, kw.get("pattern", "v2"), kw.get("vocab_size", 2**17), kw.get("num_special_tokens", 1000)
    )


def _byte_level(path: str | None, kw: dict[str, Any]) -> MegatronTokenizer:
    return ByteLevelTokenizer(
        kw.get("special_tokens"),
        kw.get("vocab_size", 512),
        kw.get("_eos_id", 0),
        kw.get("_pad_id", 1),
        kw.get("_bos_id"),
    )


BUILDERS: dict[str, Callable[[str | None, dict[str, Any]], MegatronTokenizer]] = {
    "null-text": _null,
    "sentencepiece": _sentencepiece,
    "huggingface": _huggingface,
    "megatron": _megatron,
    "tiktoken": _tiktoken,
    "byte-level": _byte_level,
}


def restore_model(library: str | None, path: str | None, kwargs: dict[str, Any]) -> MegatronTokenizer:
    """Our tokenizer for ``library`` at ``path``.

    Raises:
        ValueError: an unknown or unprovided library (named), or an option this library does not
            accept or whose value would change the ids (named, with the accepted values).
    """
    if library in REFUSED_LIBRARIES:
        raise ConfigError(
            f"tokenizer library {library!r}: {REFUSED_LIBRARIES[library]}; choose one of {sorted(BUILDERS)}"
        )
    if library not in BUILDERS:
        raise ConfigError(f"tokenizer library {library!r} is not valid; choose one of {sorted(BUILDERS)}")
    accepted = OPTIONS[library]
    for name, value in kwargs.items():
        if name not in accepted:
            raise ConfigError(
                f"tokenizer library {library!r} takes no option {name!r}; it takes {sorted(accepted)}"
            )
        neutral = accepted[name]
        if neutral is not ANY and value not in neutral:
            raise ConfigError(
                f"tokenizer library {library!r}: {name}={value!r} is not supported here; leave it at "
                f"{neutral[0]!r}"
            )
    return BUILDERS[library](path, kwargs)


class MegatronTokenizerText(MegatronTokenizer):
    """A text tokenizer as ``MegatronTokenizer.from_pretrained`` returns it.

    Args:
        path: the tokenizer file or directory (None for ``null-text``).
        config: the metadata (``library``, ``model_type``, ``chat_template``, ...); every entry also
            becomes an attribute, as in Megatron-Core.
        **kwargs: the library's options (see ``OPTIONS``), kept as ``additional_args``.

    ``unique_identifiers`` (hashed into dataset cache keys) holds this class's qualified name, the
    path and each option as a string.
    """

    def __init__(self, path: str | None, config: dict[str, Any], **kwargs: Any) -> None:
        for key, value in config.items():
            setattr(self, key, value)
        self.path = path
        self.library = config.get("library")
        self._tokenizer = restore_model(self.library, path, kwargs)
        self.additional_args = kwargs
        self.chat_template = config.get("chat_template") or kwargs.get("chat_template")
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_path"] = path
        for key, value in kwargs.items():
            ids[key] = str(value)
        self.unique_identifiers = ids

    # ------------------------------------------------------------------ encode / decode
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tokenizer.tokenize(text))

    def tokenize_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        return self._tokenizer.tokenize_batch(texts)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        """Text of ``ids``; ``skip_special_tokens=True`` is refused (special tokens are kept)."""
        if skip_special_tokens:
            raise ValueError(
                "detokenize(skip_special_tokens=True) is not supported here; special tokens are kept"
            )
        return self._tokenizer.detokenize(ids)

    def apply_chat_template(self, conversation: Any, chat_template: str | None = None, **kwargs: Any) -> Any:
        raise NotImplementedError("apply_chat_template is not provided (no jinja chat templates here)")

    # ------------------------------------------------------------------ ids and sizes
    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def eod(self) -> int:
        return self._tokenizer.eod

    @property
    def pad(self) -> int:
        return self._tokenizer.pad

    @property
    def bos(self) -> int:
        return self._tokenizer.bos

    @property
    def eos(self) -> int:
        return self._tokenizer.eos

    @property
    def bos_id(self) -> int:
        return self.bos

    @property
    def eos_id(self) -> int:
        return self.eos

    @property
    def unk(self) -> int:
        return int(getattr(self._tokenizer, "unk", -1))

    @property
    def unk_id(self) -> int:
        return self.unk

    @property
    def cls(self) -> int:
        return -1

    @property
    def cls_id(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def sep_id(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def mask_id(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self) -> list[int] | None:
        return None

    @property
    def vocab_file(self) -> str | None:
        return self.additional_args.get("vocab_file")

    @property
    def merges_file(self) -> str | None:
        return self.additional_args.get("merges_file")

    @property
    def vocab(self) -> dict[str, int]:
        """Token string -> id, where the underlying tokenizer exposes one."""
        inner = self._tokenizer
        if hasattr(inner, "_tok"):
            return dict(inner._tok.get_vocab(with_added_tokens=True))
        raise NotImplementedError(f"vocab is not available for library {self.library!r}")

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}
