"""ByteLevelTokenizer: the UTF-8 bytes of the text are its ids (Megatron-Core's ``byte-level``).

Ids 0-255 are bytes; special tokens take the ids below ``vocab_size`` from the top down. As in
Megatron-Core, eos (= eod) and pad default to ids 0 and 1, which are also the bytes 0x00 and 0x01.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizer.base import MegatronTokenizer


class ByteLevelTokenizer(MegatronTokenizer):
    """Args:
        special_tokens: names given the ids ``vocab_size + n - 1`` downwards (the vocabulary grows
            by their number).
        vocab_size: ids before the special tokens (default 512).
        eos_id: end-of-sequence id, also eod (default 0).
        pad_id: padding id (default 1).
        bos_id: beginning-of-sequence id (default none: -1).

    Raises:
        ValueError: a ``vocab_size`` below 256.
    """

    def __init__(
        self,
        special_tokens: Sequence[str] | None = None,
        vocab_size: int = 512,
        eos_id: int = 0,
        pad_id: int = 1,
        bos_id: int | None = None,
    ) -> None:
        if int(vocab_size) < 256:
            raise ConfigError(
                f"vocab_size {vocab_size} must be >= 256 for the byte-level tokenizer", params=("vocab_size",)
            )
        specials = list(special_tokens or [])
        super().__init__(
            vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id, special_tokens=specials
        )
        self._vocab_size = int(vocab_size) + len(specials)
        self.special_start = self._vocab_size - len(specials)
        self._eod = int(eos_id)
        self._pad = int(pad_id)
        self._bos = -1 if bos_id is None else int(bos_id)

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def unk(self) -> int:
        return 259

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of the byte ids (special-token ids dropped), trailing whitespace removed."""
        return (
            bytes(int(i) for i in ids if int(i) < min(self.special_start, 256))
            .decode("utf-8", errors="ignore")
            .rstrip()
        )
