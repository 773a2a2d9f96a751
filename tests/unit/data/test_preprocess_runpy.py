"""tools/preprocess_data.py as Megatron-LM's users drive it from Python: runpy with sys.argv set, and
its ``Encoder``."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys

import pytest
from data_test_utils import SAMPLE_TEXT, train_byte_level_bpe

from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def run_tool(monkeypatch, *flags):
    monkeypatch.setattr(sys, "argv", [TOOL, *flags])
    return runpy.run_path(TOOL, run_name="__main__")


def test_runpy_returns_normally_and_writes_the_pair(tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"text": " ".join(str(j) for j in range(i))}) + "\n" for i in range(1, 6))
    )
    prefix = str(tmp_path / "out")
    handler = signal.getsignal(signal.SIGINT)
    module = run_tool(
        monkeypatch,
        "--input",
        str(src),
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--append-eod",
        "--workers",
        "1",
    )
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back
    ds = IndexedDataset(prefix + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [list(range(i)) + [99] for i in range(1, 6)]
    assert {"Encoder", "get_args", "main"} <= set(module)


def test_runpy_failure_exits_non_zero(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        run_tool(
            monkeypatch,
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        )
    assert e.value.code == 2


@pytest.fixture(scope="module")
def tool():
    return runpy.run_path(TOOL)  # imported, not run


def test_get_args_reads_sys_argv(tool, tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2"}\n')
    monkeypatch.setattr(
        sys,
        "argv",
        [
            TOOL,
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "10",
            "--append-eod",
        ],
    )
    args = tool["get_args"]()
    assert args.json_keys == ["text"] and args.append_eod and args.output_prefix == str(tmp_path / "o")


def test_encoder_matches_the_tool_output(tool, tmp_path, monkeypatch):
    vocab, merges = train_byte_level_bpe(SAMPLE_TEXT, str(tmp_path))
    docs = [
        {"text": SAMPLE_TEXT[0], "title": [SAMPLE_TEXT[1], "", SAMPLE_TEXT[2]]},
        {"text": "", "title": [SAMPLE_TEXT[3]]},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    prefix = str(tmp_path / "bpe")
    flags = [
        "--input",
        str(src),
        "--output-prefix",
        prefix,
        "--json-keys",
        "text",
        "title",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--append-eod",
    ]
    run_tool(monkeypatch, *flags)
    monkeypatch.setattr(sys, "argv", [TOOL, *flags])
    encoder = tool["Encoder"](tool["get_args"]())
    encoder.initializer()
    tok = encoder.tokenizer
    for key in ("text", "title"):
        ds = IndexedDataset(f"{prefix}_{key}_document")
        for d_i, doc in enumerate(docs):
            line = json.dumps(doc)
            ids, lens, size = encoder.encode(line)
            assert size == len(line)
            start, end = ds.document_indices[d_i], ds.document_indices[d_i + 1]
            written = [ds[i].tolist() for i in range(start, end)]  # the sequences of document d_i
            assert lens[key] == [len(x) for x in written]
            assert ids[key] == [t for x in written for t in x]
    ids, lens, _ = encoder.encode(json.dumps(docs[0]))
    pieces = [SAMPLE_TEXT[1], SAMPLE_TEXT[2]]  # the empty sentence has no tokens and no length
    assert ids["title"] == tok.tokenize(pieces[0]) + tok.tokenize(pieces[1]) + [tok.eod]
    assert lens["title"] == [len(tok.tokenize(pieces[0])), len(tok.tokenize(pieces[1])) + 1]
    assert encoder.encode(json.dumps(docs[1]))[0]["text"] == []  # an empty document gets no eod


def test_encoder_split_and_bad_line(tool):
    args = argparse.Namespace(
        json_keys=["text"], append_eod=False, tokenizer_type="NullTokenizer", vocab_size=10
    )
    encoder = tool["Encoder"](args)
    encoder.initializer()
    assert encoder.split('{"text": "1 2"}') == (json.dumps({"text": ["1 2"]}), len('{"text": "1 2"}'))
    assert encoder.encode('{"text": "3 4"}')[:2] == ({"text": [3, 4]}, {"text": [2]})
    with pytest.raises(ValueError, match="missing key 'text'"):
        encoder.encode('{"other": "1"}')
