"""Megatron-Core 0.19.2's ``megatron.core.tokenizers``: MegatronTokenizer.from_pretrained picks the
library from the metadata (file or dict) and gives the ids of our tokenizer classes."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest
from data_test_utils import SAMPLE_TEXT, train_byte_level_bpe

from megatron.core.tokenizer import build_tokenizer as our_build_tokenizer
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from megatron.core.tokenizers.text import MegatronTokenizerText
from megatron.core.tokenizers.text.models import GPTTokenizer
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding


def test_null_text_with_the_examples_spelling():
    """run_simple_mcore_train_loop.py calls from_pretrained(metdata_path=..., vocab_size=...)."""
    tok = MegatronTokenizer.from_pretrained(metdata_path={"library": "null-text"}, vocab_size=64)
    assert isinstance(tok, MegatronTokenizerText) and isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod, tok.pad, tok.library, tok.path) == (64, 63, -1, "null-text", None)
    assert tok.tokenize("1 2 63") == [1, 2, 63] and tok.detokenize([4, 5]) == "4 5"
    assert "metdata_path" not in tok.additional_args
    ids = tok.unique_identifiers
    assert (
        ids["class"] == "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"
        and ids["vocab_size"] == "64"
    )
    json.dumps(ids)
    tok = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=10, eod_id=0, pad_id=3
    )
    assert (tok.eod, tok.pad, tok.pad_id, tok.eos_id, tok.cls, tok.sep, tok.mask) == (0, 3, 3, 0, -1, -1, -1)


def test_null_text_feeds_the_mock_dataset():
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    tok = MegatronTokenizer.from_pretrained(metdata_path={"library": "null-text"}, vocab_size=64)
    cfg = GPTDatasetConfig(
        random_seed=0,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tok,
        log=lambda _: None,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [8, None, None], lambda: True, cfg).build()
    assert len(train) >= 8 and int(train[0]["tokens"].max()) < 64


def test_sentencepiece_from_metadata_file(tmp_path):
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
    model = prefix + ".model"
    MegatronTokenizer.write_metadata(model, "sentencepiece", model_type="gpt")
    meta = json.loads((tmp_path / "tokenizer_metadata.json").read_text())
    assert meta == {
        "library": "sentencepiece",
        "class_name": None,
        "class_path": None,
        "model_type": "gpt",
        "chat_template": None,
    }
    with pytest.raises(ValueError, match="overwrite"):
        MegatronTokenizer.write_metadata(model, "sentencepiece")
    tok = MegatronTokenizer.from_pretrained(model)  # metadata found beside the model
    ours = our_build_tokenizer(
        SimpleNamespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    )
    assert isinstance(tok, GPTTokenizer) and tok.metadata_path.endswith("tokenizer_metadata.json")
    for text in SAMPLE_TEXT[:4]:
        assert tok.tokenize(text) == ours.tokenize(text)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (ours.vocab_size, ours.eod, ours.bos, ours.pad)
    with pytest.raises(ValueError, match="legacy"):
        MegatronTokenizer.from_pretrained(model, legacy=True)


def test_huggingface_directory(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    hf = ByteLevelBPETokenizer()
    hf.train_from_iterator(
        SAMPLE_TEXT, vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = MegatronTokenizer.from_pretrained(
        str(tmp_path), metadata_path={"library": "huggingface"}, use_fast=True, include_special_tokens=True
    )
    ours = our_build_tokenizer(
        SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    )
    assert tok.tokenize(SAMPLE_TEXT[0]) == ours.tokenize(SAMPLE_TEXT[0])
    assert (tok.eod, tok.pad, tok.vocab_size) == (0, 1, 300) and tok.vocab["<pad>"] == 1 and tok.inv_vocab[0]
    with pytest.raises(ValueError, match="vocab_file"):
        MegatronTokenizer.from_pretrained(
            str(tmp_path), metadata_path={"library": "huggingface"}, vocab_file="v.json"
        )
    with pytest.raises(ValueError, match="tokenizer_path"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "huggingface"})


def test_megatron_gpt2_bpe(tmp_path):
    vocab, merges = train_byte_level_bpe(SAMPLE_TEXT, str(tmp_path))
    tok = MegatronTokenizer.from_pretrained(
        "GPT2BPETokenizer", metadata_path={"library": "megatron"}, vocab_file=vocab, merges_file=merges
    )
    ours = our_build_tokenizer(
        SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    )
    assert tok.tokenize(SAMPLE_TEXT[1]) == ours.tokenize(SAMPLE_TEXT[1]) and tok.eod == ours.eod
    assert tok.detokenize(tok.tokenize(SAMPLE_TEXT[1])) == SAMPLE_TEXT[1]
    assert (tok.vocab_file, tok.merges_file) == (vocab, merges)
    args = SimpleNamespace(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        pad_vocab_size=True,
        padded_vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=2,
        rank=0,
    )
    built = build_tokenizer(args)
    assert built.tokenize(SAMPLE_TEXT[1]) == ours.tokenize(SAMPLE_TEXT[1])
    assert args.padded_vocab_size == 512 and vocab_size_with_padding(300, args, logging_enabled=False) == 512
    with pytest.raises(ValueError, match="BertWordPieceCase"):
        MegatronTokenizer.from_pretrained("BertWordPieceCase", metadata_path={"library": "megatron"})


def test_tiktoken(tmp_path):
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the"]
    path = tmp_path / "ranks.json"
    path.write_text(
        json.dumps(
            [
                {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
                for i, t in enumerate(ranks)
            ]
        )
    )
    tok = MegatronTokenizer.from_pretrained(
        str(path), metadata_path={"library": "tiktoken"}, pattern="v2", num_special_tokens=1000
    )
    ours = our_build_tokenizer(
        SimpleNamespace(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(path),
            tiktoken_pattern="v2",
            vocab_size=None,
            tiktoken_num_special_tokens=1000,
        )
    )
    assert tok.tokenize("the theme") == ours.tokenize("the theme") and (tok.eod, tok.bos) == (2, 1)


def test_build_tokenizer_null_and_errors():
    args = SimpleNamespace(
        tokenizer_type="NullTokenizer",
        vocab_size=100,
        null_tokenizer_eod_id=None,
        pad_vocab_size=True,
        padded_vocab_size=None,
        make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=1,
    )
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (100, 99, 128)
    with pytest.raises(ValueError, match="tokenizer_type"):
        build_tokenizer(SimpleNamespace(tokenizer_type="Bogus"))
    with pytest.raises(ValueError, match="'sft'"):
        build_tokenizer(SimpleNamespace(tokenizer_type="SFTTokenizer", tokenizer_model="x"))


def test_byte_level():
    tok = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "byte-level"}, special_tokens=["<a>", "<b>"]
    )
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (514, 0, 1, -1)
    assert tok.tokenize("h\u00e9llo") == [104, 195, 169, 108, 108, 111]
    assert tok.detokenize([104, 105, 513, 32]) == "hi"  # special ids dropped, trailing space stripped
    assert tok.unique_identifiers["special_tokens"] == "['<a>', '<b>']"


@pytest.mark.parametrize("library", ["sft", "multimodal", "null-multimodal", "bogus"])
def test_libraries_not_provided_are_named(library):
    with pytest.raises(ValueError, match=repr(library)):
        MegatronTokenizer.from_pretrained("some/path", metadata_path={"library": library})


def test_refusals_name_the_parameter(tmp_path):
    with pytest.raises(OSError):
        MegatronTokenizer()
    with pytest.raises(ValueError, match="write_metadata"):
        MegatronTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="metadata_path"):
        MegatronTokenizer.from_pretrained()
    with pytest.raises(ValueError, match="vocab_size"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"})
    with pytest.raises(ValueError, match="model_type"):
        MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text", "model_type": "llava"}, vocab_size=4
        )
    with pytest.raises(ValueError, match="'frobnicate'"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=4, frobnicate=1)
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=4)
    with pytest.raises(ValueError, match="skip_special_tokens"):
        tok.detokenize([1], skip_special_tokens=True)
    assert np.array_equal(tok.tokenize_batch(["1 2", "3"])[0], [1, 2])
