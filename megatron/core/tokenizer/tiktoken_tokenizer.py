"""TikTokenizer: a ``tiktoken`` BPE read from a local ranks file; nothing is downloaded."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.errors import DataError
from megatron.core.tokenizer.base import MegatronTokenizer, require_file

# Pre-tokenisation patterns of Megatron-LM's TikTokenizer (``--tiktoken-pattern v1|v2``).
PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def load_ranks(path: str, max_vocab: int | None) -> dict[bytes, int]:
    """Mergeable ranks from a JSON list of ``{rank, token_bytes (base64), token_str}`` or a
    ``.tiktoken`` text file (``base64 rank`` per line), cut to the first ``max_vocab`` entries."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            entries = [(base64.b64decode(e["token_bytes"]), int(e["rank"])) for e in json.loads(text)]
        else:
            entries = [
                (base64.b64decode(a), int(b)) for a, b in (ln.split() for ln in text.splitlines() if ln)
            ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"tokenizer_model {path!r} is not a tiktoken ranks file: {exc}", params=("tokenizer_model",)
        ) from None
    entries.sort(key=lambda e: e[1])
    if max_vocab is not None:
        entries = entries[:max_vocab]
    ranks = {tok: rank for tok, rank in entries}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(
            f"tokenizer_model {path!r}: ranks must be unique and contiguous from 0",
            params=("tokenizer_model",),
        )
    return ranks


class TikTokenizer(MegatronTokenizer):
    """Ids ``0 .. num_special_tokens-1`` are specials (``<unk>, <s>, </s>, ...``); BPE ranks follow.

    Args:
        path: ``--tokenizer-model`` ranks file.
        pattern: ``--tiktoken-pattern`` (``v1`` or ``v2``).
        vocab_size: ``--vocab-size``, total ids including specials (default 2**17).
        num_special_tokens: ``--tiktoken-num-special-tokens`` (default 1000).
    """

    def __init__(
        self,
        path: str | None,
        pattern: str = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
    ) -> None:
        import tiktoken

        path = require_file(path, "tokenizer_model", "TikTokenizer")
        if pattern not in ("v1", "v2"):
            raise ConfigError(
                f"tiktoken_pattern {pattern!r} is not valid; choose one of ['v1', 'v2']",
                params=("tiktoken_pattern",),
            )
        vocab_size = 2**17 if vocab_size is None else int(vocab_size)
        if num_special_tokens < len(SPECIAL_TOKENS) or vocab_size <= num_special_tokens:
            raise ConfigError(
                f"tiktoken_num_special_tokens {num_special_tokens} must be >= {len(SPECIAL_TOKENS)} "
                f"and below vocab_size {vocab_size}",
                params=("vocab_size", "tiktoken_num_special_tokens"),
            )
        super().__init__(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens)
        ranks = load_ranks(path, vocab_size - num_special_tokens)
        self._num_special = num_special_tokens
        self._vocab_size = len(ranks) + num_special_tokens
        self._specials = SPECIAL_TOKENS + [
            f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)
        ]
        self._enc = tiktoken.Encoding(
            name=f"megatron-{pattern}",
            pat_str=PATTERN_V1 if pattern == "v1" else PATTERN_V2,
            mergeable_ranks=ranks,
            special_tokens={},
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._specials.index("</s>")

    @property
    def bos(self) -> int:
        return self._specials.index("<s>")

    @property
    def pad(self) -> int:
        return self._specials.index("<pad>")

    def tokenize(self, text: str) -> list[int]:
        return [t + self._num_special for t in self._enc.encode_ordinary(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        shift = self._num_special
        return [[t + shift for t in ids] for ids in self._enc.encode_ordinary_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in (int(x) for x in ids):
            if i < self._num_special:
                if run:
                    out.append(self._enc.decode(run))
                    run = []
                out.append(self._specials[i])
            else:
                run.append(i - self._num_special)
        if run:
            out.append(self._enc.decode(run))
        return "".join(out)
