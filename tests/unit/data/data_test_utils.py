"""Helpers of the data tests: small synthetic indexed datasets and tokenizers."""

from __future__ import annotations

import numpy as np

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder


def write_dataset(prefix: str, docs: list[np.ndarray], vocab_size: int = 1000) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for d in docs:
        builder.add_item(d)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def random_docs(
    seed: int, n: int, vocab_size: int = 1000, eod: int | None = None, max_len: int = 200
) -> list[np.ndarray]:
    """Documents of random length whose last token is ``eod`` (vocab_size - 1 by default)."""
    rng = np.random.default_rng(seed)
    eod = vocab_size - 1 if eod is None else eod
    docs = []
    for _ in range(n):
        body = rng.integers(0, vocab_size - 1, size=int(rng.integers(1, max_len)))
        docs.append(np.concatenate([body, [eod]]).astype(np.int64))
    return docs


def train_byte_level_bpe(texts: list[str], out_dir: str, vocab_size: int = 400) -> tuple[str, str]:
    """A small GPT-2 style vocab.json + merges.txt trained on ``texts``."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save_model(out_dir)
    return f"{out_dir}/vocab.json", f"{out_dir}/merges.txt"


SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers turn text into integers; the data path turns integers into samples.",
    "Ünïcödé and emoji 🙂 must survive a round trip, as must    runs of spaces\nand newlines.",
    "def f(x):\n    return x * 2  # code is text too",
] * 5
