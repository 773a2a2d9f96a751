"""SentencePiece tokenizers (``--tokenizer-model file.model``)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.datasets.errors import DataError
from megatron.core.tokenizer.base import MegatronTokenizer, require_file


class SentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model; eod is the model's eos id, pad its pad id (or -1).

    Args:
        model_file: ``--tokenizer-model``, a SentencePiece ``.model`` file.

    Raises:
        ValueError: the file is missing, not a SentencePiece model, or the model has no eos piece.
    """

    def __init__(self, model_file: str | None) -> None:
        import sentencepiece

        model_file = require_file(model_file, "tokenizer_model", type(self).__name__)
        super().__init__(model_file)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise DataError(
                f"tokenizer_model {model_file!r} is not a SentencePiece model: {exc}",
                params=("tokenizer_model",),
            ) from None
        if self._sp.eos_id() < 0:
            raise DataError(
                f"tokenizer_model {model_file!r} has no eos piece (used as end-of-document)",
                params=("tokenizer_model",),
            )

    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad(self) -> int:
        return int(self._sp.pad_id())

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        return self._sp.Encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """SentencePiece for GPT pretraining: no extra special tokens; eod = eos."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Llama-2's SentencePiece model; ``tokenize`` adds no bos (the data path appends eod only)."""
