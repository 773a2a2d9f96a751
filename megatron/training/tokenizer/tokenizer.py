"""``megatron.training.tokenizer.tokenizer``: the names Megatron-LM's scripts and examples import.

The tokenizers themselves live in ``megatron.core.tokenizer``.
"""

from __future__ import annotations

from megatron.core.tokenizer import NullTokenizer


class _NullTokenizer(NullTokenizer):
    """Megatron-LM's ``_NullTokenizer(vocab_size)``: ids ``0 .. vocab_size - 1`` plus one more, the
    end-of-document id ``vocab_size`` (so ``.vocab_size`` is ``vocab_size + 1``)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=int(vocab_size) + 1, eod_id=int(vocab_size))
