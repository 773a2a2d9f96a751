"""The tokenizer interface every data path relies on.

A ``MegatronTokenizer`` turns text into token ids and back. The data pipeline only needs
``vocab_size`` (unpadded), ``eod``, ``pad`` (or -1), ``tokenize``/``detokenize`` and
``unique_identifiers`` (a JSON-serialisable dict hashed into the dataset cache keys, so two
tokenizers with equal identifiers must produce equal ids).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from megatron.core.config_utils import ConfigError


class MegatronTokenizer(ABC):
    """Abstract tokenizer. Subclasses set ``self.unique_identifiers`` entries in ``__init__``."""

    _vocab_size: int
    _eod: int

    def __init__(self, *paths: str | None, **options: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(p) for p in paths if p is not None]
        for key, value in options.items():
            self.unique_identifiers[key] = str(value)

    # Subclasses set ``_vocab_size`` and ``_eod`` (and ``_pad`` when they have one) in ``__init__``,
    # or override these properties.
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (before padding for the embedding table)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """End-of-document id appended by ``--append-eod`` and used by the masking flags."""
        return self._eod

    @property
    def pad(self) -> int:
        """Padding id, or -1 when the tokenizer has none."""
        return getattr(self, "_pad", -1)

    @property
    def bos(self) -> int:
        return -1

    @property
    def eos(self) -> int:
        return self.eod

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-document id is added)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        """Ids of many texts; subclasses with a native batch encoder override this for speed."""
        return [self.tokenize(t) for t in texts]

    # Megatron-Core aliases.
    def text_to_ids(self, text: str) -> list[int]:
        return self.tokenize(text)

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self.detokenize(ids)

    @property
    def pad_id(self) -> int:
        return self.pad

    @property
    def eod_id(self) -> int:
        return self.eod


class FastTokenizer(MegatronTokenizer):
    """Encode/decode through a Hugging Face ``tokenizers.Tokenizer`` held in ``self._tok``."""

    _tok: Any

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def require_file(path: str | None, param: str, what: str) -> str:
    """Return ``path`` if it names an existing file, else raise a ``ConfigError`` naming the
    parameter ``param`` (e.g. ``tokenizer_model``) that should name it."""
    if not path:
        raise ConfigError(f"{param} is required for {what}", params=(param,))
    if not os.path.isfile(path):
        raise ConfigError(
            f"{param} {path!r} does not exist or is not a file (needed by {what})", params=(param,)
        )
    return path
