"""Megatron-LM's Mixtral launch script runs here unchanged but for sizes and degrees.

The flag set is that of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh: every flag
kept, values scaled down to a CPU (layers, widths, batch sizes, lengths, iterations) and its pp4 x ep8
to pp2 x ep2 on 4 processes. Its Llama2Tokenizer is a small SentencePiece model trained on the bundled
corpus, and the corpus preprocessed with it gives --data-path. It runs under torchrun, stops half-way
with --exit-interval, resumes from its checkpoint (weights only: the script's --no-load-optim
--no-load-rng) and trains to the end.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import pytest
from launch import ROOT, metrics, torchrun_many

from megatron.training import checkpointing


@pytest.fixture(scope="module")
def llama2_corpus(tmp_path_factory) -> tuple[str, str]:
    return prepare_llama2_corpus(str(tmp_path_factory.mktemp("sp_corpus")))


def prepare_llama2_corpus(out: str) -> tuple[str, str]:
    """(SentencePiece model, data prefix) in ``out``: the bundled corpus tokenized with a 512-piece
    BPE model trained on it."""
    import sentencepiece as spm

    corpus = os.path.join(ROOT, "data", "python_docs.jsonl.gz")
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    prefix = os.path.join(out, "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=prefix,
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus]
    cmd += ["--output-prefix", os.path.join(out, "corpus"), "--tokenizer-type", "Llama2Tokenizer"]
    cmd += ["--tokenizer-model", prefix + ".model", "--append-eod", "--workers", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return prefix + ".model", os.path.join(out, "corpus_text_document")


def mixtral_8x7b(tokenizer_model: str, data_path: str, ckpt: str) -> list[str]:
    """examples/mixtral/train_mixtral_8x7b_distributed.sh (32 layers, 8 experts, pp4 x ep8) scaled to
    4 processes: pp2 x ep2 (dense dp2), 4 layers of width 64, 8 experts."""
    model = [
        "--use-mcore-models",
        "--disable-bias-linear",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "512",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "224",
        "--num-attention-heads",
        "8",
        "--init-method-std",
        "0.01",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--no-masked-softmax-fusion",
        "--no-position-embedding",
        "--rotary-base",
        "1000000",
    ]
    moe = [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-router-load-balancing-type",
        "aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
    ]
    data = [
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        tokenizer_model,
        "--data-path",
        data_path,
        "--split",
        "99990,8,2",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--lr",
        "1e-4",
        "--train-iters",
        "6",
        "--lr-decay-iters",
        "4",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "1.0e-5",
        "--weight-decay",
        "0.1",
        "--lr-warmup-iters",
        "1",
        "--clip-grad",
        "1.0",
        "--bf16",
    ]
    parallel = [
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--sequence-parallel",
    ]
    logging = [
        "--log-interval",
        "1",
        "--save-interval",
        "3",
        "--eval-interval",
        "3",
        "--eval-iters",
        "2",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--tensorboard-dir",
        f"{ckpt}/tensorboard",
        "--no-load-optim",
        "--no-load-rng",
    ]
    return model + moe + data + training + parallel + logging


@pytest.mark.slow
def test_mixtral_8x7b_example_flags_train_stop_and_resume(llama2_corpus, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = mixtral_8x7b(*llama2_corpus, ckpt)
    stop, end = 3, 6
    # One launch, two runs: the second starts from the tracker the first left.
    first, second = torchrun_many(4, [flags + ["--exit-interval", str(stop)], flags])
    assert (
        re.search(rf"iteration +{stop}/ +{end}", first.stdout)
        and f"iteration {stop + 1}/" not in first.stdout
    )
    assert f"successfully loaded checkpoint from {ckpt} at iteration {stop}" in second.stdout.replace("'", "")
    assert re.search(rf"iteration +{end}/ +{end}", second.stdout)
    assert checkpointing.read_tracker(ckpt) == end
    for out in (first.stdout + first.stderr, second.stdout + second.stderr):
        assert "Traceback" not in out and "unrecognized" not in out
    # Every iteration logged once over both runs, with the MoE figures (the bf16 loss is never skipped).
    recs = metrics(f"{ckpt}/tensorboard/metrics.jsonl", "lm loss")
    assert sorted(recs) == list(range(1, end + 1))
    for rec in recs.values():
        assert rec["load_balancing_loss"] > 0.99 and rec["expert_load_imbalance"] >= 1.0
    assert " > experts: 8 of FFN" in first.stdout
