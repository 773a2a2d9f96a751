"""tools/preprocess_data.py and tools/merge_datasets.py end to end (subprocesses, as users run them)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from data_test_utils import SAMPLE_TEXT, train_byte_level_bpe

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizer import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def tool(name, *args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", name), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def integer_corpus(path, n=500):
    """Deterministic NullTokenizer input: document i holds i % 37 integers (0 = empty text)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(str((i * 7 + j) % 997) for j in range(i % 37))}) + "\n")


def md5(path):
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def test_golden_checksum_and_workers_agree(tmp_path):
    src = tmp_path / "in.jsonl"
    integer_corpus(src)
    outs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        r = tool(
            "preprocess_data.py",
            "--input",
            str(src),
            "--output-prefix",
            prefix,
            *NULL,
            "--append-eod",
            "--workers",
            str(workers),
        )
        assert r.returncode == 0, r.stderr
        outs[workers] = (md5(prefix + "_text_document.bin"), md5(prefix + "_text_document.idx"))
    assert outs[1] == outs[2]
    # Pinned once from this input; any change to the byte layout or EOD/empty-document rules shows here.
    assert outs[1] == ("18d7193c585f22db71cffb7a2442a1bf", "4123efbf9b078428853af8f1d80e976e")
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    assert len(ds.document_indices) == 501 and len(ds) == 500 - 14  # 14 empty texts: no sequence
    assert ds[0].tolist() == [7, 999] and ds[1].tolist() == [14, 15, 999]  # document 0 is empty


def test_bpe_tokens_match_the_tokenizer_and_gzip_glob_inputs(tmp_path):
    vocab, merges = train_byte_level_bpe(SAMPLE_TEXT, str(tmp_path))
    for i in range(2):
        with gzip.open(tmp_path / f"part{i}.jsonl.gz", "wt", encoding="utf-8") as f:
            for t in SAMPLE_TEXT[i::2]:
                f.write(json.dumps({"text": t, "title": t[:10]}) + "\n")
    prefix = str(tmp_path / "bpe")
    r = tool(
        "preprocess_data.py",
        "--input",
        str(tmp_path / "part*.jsonl.gz"),
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
        "--workers",
        "2",
        "--log-interval",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "Processed" in r.stderr and "MB/s" in r.stderr
    tok = build_tokenizer(
        type("C", (), {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges})()
    )
    ds = IndexedDataset(prefix + "_text_document")
    expected = SAMPLE_TEXT[0::2] + SAMPLE_TEXT[1::2]
    assert len(ds) == len(expected)
    for i, text in enumerate(expected):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    assert len(IndexedDataset(prefix + "_title_document")) == len(expected)


def test_malformed_lines_are_counted_and_skipped(tmp_path):
    src = tmp_path / "bad.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"text": "1 2 3"}\n')
        f.write(b'{"text": "4 5\n')  # malformed JSON (line 2)
        f.write(b'{"other": "6"}\n')  # missing key (line 3)
        f.write(b'{"text": "7 \xff 8"}\n')  # invalid UTF-8 (line 4)
        f.write(b'{"text": 12}\n')  # not a string (line 5)
        f.write(b'{"text": "9"}\n')
    prefix = str(tmp_path / "bad")
    r = tool("preprocess_data.py", "--input", str(src), "--output-prefix", prefix, *NULL, "--append-eod")
    assert r.returncode == 0, r.stderr
    assert "Skipped 4 lines" in r.stderr
    for needle in (
        "bad.jsonl:2: malformed JSON",
        "bad.jsonl:3: missing key 'text'",
        "bad.jsonl:4: invalid UTF-8",
        "bad.jsonl:5: key 'text' is not a string",
    ):
        assert needle in r.stderr
    ds = IndexedDataset(prefix + "_text_document")
    assert [x.tolist() for x in ds[0:2]] == [[1, 2, 3, 999], [9, 999]]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "/nonexistent.jsonl"], "--input '/nonexistent.jsonl' does not exist"),
        (["--input", "/nonexistent*.jsonl"], "matches no file"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file is required"),
    ],
)
def test_user_errors_print_one_line(tmp_path, args, message):
    src = tmp_path / "in.jsonl"
    integer_corpus(src, 3)
    base = {"--input": str(src), "--output-prefix": str(tmp_path / "o"), **dict(zip(NULL[::2], NULL[1::2]))}
    base.update(dict(zip(args[::2], args[1::2])))
    r = tool("preprocess_data.py", *[x for kv in base.items() for x in kv])
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_merge_datasets(tmp_path):
    for i in range(2):
        src = tmp_path / f"in{i}.jsonl"
        integer_corpus(src, 50 + 10 * i)
        assert (
            tool(
                "preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / f"p{i}"), *NULL
            ).returncode
            == 0
        )
    out = str(tmp_path / "merged")
    r = tool("merge_datasets.py", "--input", str(tmp_path), "--output-prefix", out)
    assert r.returncode == 0, r.stderr
    merged, a, b = (
        IndexedDataset(p)
        for p in (out, str(tmp_path / "p0_text_document"), str(tmp_path / "p1_text_document"))
    )
    assert len(merged) == len(a) + len(b)
    assert all(np.array_equal(merged[i], x) for i, x in enumerate(list(a[0 : len(a)]) + list(b[0 : len(b)])))
