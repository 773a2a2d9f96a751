"""Issue 22, end to end: the bundled corpus as examples/prepare_corpus.sh prepares it, merged after a
training run left its index cache, trained with the example's --split; the attention-mask flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from launch import ROOT, metrics, torchrun

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.cli import run

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --num-workers 0 --log-interval 1 "
    "--hidden-dropout 0 --attention-dropout 0"
).split()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A tiny training on the example's own flags (--split 949,50,1 leaves the 399 documents' test split
    none): its stdout and stderr."""
    flags, _ = corpus
    metrics_file = tmp_path_factory.mktemp("run") / "m.jsonl"
    res = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "pretrain_gpt.py"),
            *MODEL,
            *flags,
            "--train-iters",
            "4",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--metrics-file",
            str(metrics_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    return res.stdout, res.stderr


def test_example_split_trains_and_skips_the_empty_test_split(corpus, trained):
    flags, _ = corpus
    assert flags[flags.index("--split") + 1] == "949,50,1"
    out, _ = trained
    line = " > test split is empty (--split 949,50,1 gives it 0 of 399 documents): no test evaluation"
    assert out.splitlines().count(line) == 1
    assert "validation loss at iteration 2 |" in out and "validation loss at iteration 4 |" in out
    assert "on validation set" in out and "on test set" not in out
    assert re.search(r"iteration +4/ +4", out)


def test_empty_train_split_is_refused_with_one_line(corpus, capsys):
    flags, _ = corpus
    flags = list(flags)
    flags[flags.index("--split") + 1] = "0,50,50"
    assert run(MODEL + flags + ["--train-iters", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pretrain_gpt.py: error: train split is empty (--split 0,50,50 gives it 0 of 399 documents); "
        "give it a share, e.g. --split 969,30,1"
    ]


def test_merge_after_training_left_its_cache(corpus, trained, tmp_path):
    _, prefix = corpus
    assert os.path.isdir(os.path.join(prefix, "cache", "GPTDataset_indices"))  # the prefix is now a directory
    docs = len(IndexedDataset(prefix).document_indices) - 1
    copy = prefix + "_copy"  # a second dataset beside it (the directory also holds vocab.json, merges.txt)
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as src, open(copy + suffix, "wb") as dst:
            dst.write(src.read())
    tool = os.path.join(ROOT, "tools", "merge_datasets.py")
    for i, (inputs, n) in enumerate((([prefix], 1), ([prefix, copy], 2), ([os.path.dirname(prefix)], 2))):
        out = str(tmp_path / f"merged{i}")
        res = subprocess.run(
            [sys.executable, tool, "--input", *inputs, "--output-prefix", out],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert len(IndexedDataset(out).document_indices) - 1 == n * docs, inputs
        assert res.stdout.strip().splitlines()[-1].startswith(f"merged {n} datasets:")
    for suffix in (".bin", ".idx"):
        os.remove(copy + suffix)


def short_documents(prefix: str, n: int = 400) -> str:
    """Documents of 3..40 tokens ending in EOD (NullTokenizer 128: id 127): several per sample."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(n):
        doc = np.append(rng.integers(0, 127, size=int(rng.integers(2, 40))), 127)
        builder.add_document(doc.astype(np.uint16), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def mask_args(tmp_path, name: str, extra: list[str]) -> list[str]:
    prefix = str(tmp_path / "short")
    if not os.path.exists(prefix + ".idx"):
        short_documents(prefix)
    return MODEL + [
        "--data-path",
        prefix,
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--train-iters",
        "6",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--metrics-file",
        str(tmp_path / f"{name}.jsonl"),
        *extra,
    ]


def lm_losses(path: str) -> dict[int, float]:
    return {it: rec["lm loss"] for it, rec in metrics(path, "lm loss").items()}


def test_mask_flag_leaves_the_losses_unchanged(tmp_path):
    runs = {}
    for reset in ("", "--reset-attention-mask"):
        for flag in ("", "--no-create-attention-mask-in-dataloader"):
            name = f"r{bool(reset)}f{bool(flag)}"
            assert run(mask_args(tmp_path, name, [x for x in (reset, flag) if x])) == 0
            runs[name] = lm_losses(str(tmp_path / f"{name}.jsonl"))
            assert sorted(runs[name]) == list(range(1, 7))
    assert runs["rFalsefFalse"] == runs["rFalsefTrue"]  # bitwise: floats compared exactly
    assert runs["rTruefFalse"] == runs["rTruefTrue"]
    assert runs["rTruefFalse"] != runs["rFalsefFalse"]  # the document mask is applied either way


@pytest.mark.slow
def test_mask_flag_under_tensor_parallelism(tmp_path):
    losses = []
    for flag in ([], ["--no-create-attention-mask-in-dataloader"]):
        name = f"tp2{len(flag)}"
        torchrun(
            2,
            mask_args(tmp_path, name, ["--reset-attention-mask", "--tensor-model-parallel-size", "2", *flag]),
        )
        losses.append(lm_losses(str(tmp_path / f"{name}.jsonl")))
    assert sorted(losses[0]) == list(range(1, 7)) and losses[0] == losses[1]
