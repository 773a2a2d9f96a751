"""NullTokenizer: text is whitespace-separated integers; used for mock data and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids are the integers written in the text.

    Args:
        vocab_size: number of ids (``--vocab-size``); ids must lie in ``[0, vocab_size)``.
        eod_id: end-of-document id (``--null-tokenizer-eod-id``), default ``vocab_size - 1``.
        pad_id: padding id (``--null-tokenizer-pad-id``), default -1 (none).

    Raises:
        ValueError: ``vocab_size`` missing or < 1, or ``eod_id`` outside the vocabulary.
    """

    def __init__(self, vocab_size: int | None, eod_id: int | None = None, pad_id: int = -1) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError(
                f"vocab_size must be a positive integer for NullTokenizer, got {vocab_size}",
                params=("vocab_size",),
            )
        vocab_size = int(vocab_size)
        eod_id = vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= eod_id < vocab_size:
            raise ConfigError(
                f"null_tokenizer_eod_id {eod_id} must lie in [0, {vocab_size})",
                params=("null_tokenizer_eod_id",),
            )
        super().__init__(vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id)
        self._vocab_size = vocab_size
        self._eod = eod_id
        self._pad = int(pad_id)

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError as exc:
            raise ValueError(f"NullTokenizer expects whitespace-separated integers: {exc}") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
