"""Tokenizers: each type round-trips, reports eod/vocab, and names the flag on errors."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import pytest
from data_test_utils import SAMPLE_TEXT, train_byte_level_bpe

from megatron.core.tokenizer import build_tokenizer, vocab_size_with_padding


def cfg(**kw):
    return SimpleNamespace(**kw)


def test_vocab_padding_is_printed():
    lines = []
    assert vocab_size_with_padding(50257, 128, 1, log=lines.append) == 50304
    assert lines == [" > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"]
    assert vocab_size_with_padding(50257, 128, 8, log=None) == 51200
    assert vocab_size_with_padding(256, 128, 2, log=None) == 256


def test_null_tokenizer():
    tok = build_tokenizer(cfg(tokenizer_type="NullTokenizer", vocab_size=100))
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, -1)
    assert tok.tokenize("3 4  5") == [3, 4, 5] and tok.detokenize([7, 8]) == "7 8"
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(cfg(tokenizer_type="NullTokenizer", vocab_size=None))


def test_gpt2_bpe(tmp_path):
    vocab, merges = train_byte_level_bpe(SAMPLE_TEXT, str(tmp_path))
    tok = build_tokenizer(cfg(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert tok.eod == json.load(open(vocab))["<|endoftext|>"]
    assert tok.vocab_size == len(json.load(open(vocab)))
    for text in SAMPLE_TEXT[:4]:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text and max(ids) < tok.vocab_size
    assert tok.tokenize_batch(SAMPLE_TEXT[:3]) == [tok.tokenize(t) for t in SAMPLE_TEXT[:3]]
    # like GPT-2's reference encoder, the literal eod string in text is not the eod id
    assert tok.eod not in tok.tokenize("a <|endoftext|> b")
    assert tok.unique_identifiers["class"] == "GPT2BPETokenizer"


def test_gpt2_bpe_errors_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="vocab_file is required for GPT2BPETokenizer"):
        build_tokenizer(cfg(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file="m"))
    vocab, merges = train_byte_level_bpe(SAMPLE_TEXT, str(tmp_path))
    with pytest.raises(ValueError, match="merge_file 'nope.txt'"):
        build_tokenizer(cfg(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file="nope.txt"))
    with pytest.raises(ValueError, match="tokenizer_type"):
        build_tokenizer(cfg(tokenizer_type="Bogus"))


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece(tmp_path, kind):
    import sentencepiece as spm

    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SAMPLE_TEXT * 4),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    tok = build_tokenizer(cfg(tokenizer_type=kind, tokenizer_model=prefix + ".model"))
    assert tok.vocab_size == 400 and tok.eod == 2  # sentencepiece's default eos id
    text = "The quick brown fox"
    assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(ValueError, match="tokenizer_model"):
        build_tokenizer(cfg(tokenizer_type=kind, tokenizer_model=str(tmp_path / "missing.model")))


def test_tiktoken_from_local_ranks(tmp_path):
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" t", b" the"]
    path = tmp_path / "ranks.json"
    path.write_text(
        json.dumps(
            [
                {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
                for i, t in enumerate(ranks)
            ]
        )
    )
    tok = build_tokenizer(
        cfg(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(path),
            tiktoken_pattern="v2",
            vocab_size=None,
            tiktoken_num_special_tokens=1000,
        )
    )
    assert tok.vocab_size == 1000 + len(ranks) and tok.eod == 2
    ids = tok.tokenize("the theme")
    assert ids[0] == 1000 + ranks.index(b"the") and tok.detokenize(ids) == "the theme"
    assert tok.detokenize([tok.eod]) == "</s>"


def test_huggingface_from_local_json(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    hf = ByteLevelBPETokenizer()
    hf.train_from_iterator(
        SAMPLE_TEXT, vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(cfg(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert tok.eod == 0 and tok.pad == 1 and tok.vocab_size == 300
    assert tok.detokenize(tok.tokenize("quick brown")) == "quick brown"
    with pytest.raises(ValueError, match="nothing is downloaded"):
        build_tokenizer(cfg(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"))


def test_megatron_lm_null_tokenizer_import_path():
    """Megatron-LM's examples import ``_NullTokenizer`` from megatron.training.tokenizer.tokenizer: its
    vocabulary holds one id more than asked, the end-of-document id."""
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    tok = _NullTokenizer(64)
    assert (tok.vocab_size, tok.eod) == (65, 64)
    assert tok.tokenize("1 2 64") == [1, 2, 64]
