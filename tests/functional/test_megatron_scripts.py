"""Megatron-LM's own example launch scripts run here unchanged but for sizes and degrees.

The flag sets are those of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh (mock-data branch): every flag kept, values scaled down
to a CPU (layers, widths, batch sizes, lengths, parallel degrees), the FP8 block left out on the CPU.
Each runs under torchrun on two processes, stops half-way with --exit-interval, resumes from its
checkpoint and trains to the end.
"""

from __future__ import annotations

import re

import pytest
from launch import metrics, torchrun_many

from megatron.training import checkpointing


def gpt3_175b(data_flags: list[str], ckpt: str, tb: str) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh (96 layers, tp8 x pp16) scaled to 2 processes."""
    prefix = data_flags[data_flags.index("--data-path") + 1]
    vocab = data_flags[data_flags.index("--vocab-file") + 1]
    merges = data_flags[data_flags.index("--merge-file") + 1]
    model = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--attention-backend",
        "auto",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--rampup-batch-size",
        "2",
        "2",
        "24",
        "--train-iters",
        "30",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.006",
        "--clip-grad",
        "1.0",
        "--fp16",
        "--lr",
        "6.0e-5",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "6.0e-6",
        "--lr-warmup-fraction",
        ".001",
        "--lr-decay-iters",
        "24",
    ]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    data = ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges, "--split", "949,50,1"]
    logging = [
        "--log-interval",
        "1",
        "--save-interval",
        "15",
        "--eval-interval",
        "15",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--eval-iters",
        "1",
        "--tensorboard-dir",
        tb,
    ]
    return model + training + parallel + data + logging


def llama3_8b(cache: str, ckpt: str, tb: str) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh, mock-data branch (32 layers, dp8), scaled to dp2.

    The script's bash arrays hold entries such as "--split '99,1,0'" expanded unquoted, so the
    launcher receives the quotes as part of the value: kept here as it arrives."""
    model = [
        "--use-mcore-models",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "224",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "1000000",
        "--rotary-percent",
        "1.0",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--swiglu",
        "--init-method-std",
        "0.0134",
        "--attention-backend",
        "fused",
        "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--train-samples",
        "48",
        "--lr-decay-samples",
        "40",
        "--lr-warmup-samples",
        "8",
        "--lr",
        "0.00015",
        "--min-lr",
        "0.00001",
        "--decoupled-lr",
        "5.0e-4",
        "--decoupled-min-lr",
        "4.5e-5",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--bf16",
        "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss",
        "--manual-gc",
        "--empty-unused-memory-level",
        "1",
        "--exit-duration-in-mins",
        "235",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
    data = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "512",
        "--data-cache-path",
        cache,
        "--tiktoken-pattern",
        "v2",
        "--split",
        "'99,1,0'",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers",
        "1",
    ]
    logging = [
        "--log-interval",
        "1",
        "--eval-iters",
        "2",
        "--eval-interval",
        "3",
        "--save-interval",
        "3",
        "--log-throughput",
        "--profile",
        "--profile-step-start",
        "4",
        "--profile-step-end",
        "6",
        "--ckpt-format",
        "torch_dist",
        "--distributed-timeout-minutes",
        "60",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--tensorboard-dir",
        tb,
    ]
    return model + training + parallel + data + logging


def _train_stop_resume(flags: list[str], ckpt: str, tb: str, stop: int, end: int) -> tuple[str, str]:
    # One launch, two runs (launch.torchrun_many): the second starts from the tracker the first left,
    # so its "loaded ... at iteration <stop>" is the first run's tracker.
    first, second = torchrun_many(2, [flags + ["--exit-interval", str(stop)], flags])
    assert (
        re.search(rf"iteration +{stop}/ +{end}", first.stdout)
        and f"iteration {stop + 1}/" not in first.stdout
    )
    assert f"successfully loaded checkpoint from {ckpt} at iteration {stop}" in second.stdout.replace("'", "")
    assert re.search(rf"iteration +{end}/ +{end}", second.stdout)
    assert checkpointing.read_tracker(ckpt) == end
    # Every iteration logged once over both launches (fp16's first steps may skip on overflow, so by
    # the learning rate every step records, not the loss a skipped step does not have).
    assert sorted(metrics(f"{tb}/metrics.jsonl", "learning-rate")) == list(range(1, end + 1))
    for out in (first.stdout + first.stderr, second.stdout + second.stderr):
        assert "Traceback" not in out and "unrecognized" not in out
    return first.stdout, second.stdout


@pytest.mark.slow
def test_gpt3_175b_example_flags_train_stop_and_resume(corpus, tmp_path):
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    first, second = _train_stop_resume(gpt3_175b(corpus[0], ckpt, tb), ckpt, tb, stop=15, end=30)
    # The ramp from 2 to 8 samples over 24 samples: 2 x 4 steps, 4 x 2, 6 x 2, then 8 (the log line and
    # consumed samples follow each step's size); across the resume too.
    steps = metrics(f"{tb}/metrics.jsonl", "batch-size")
    assert [int(steps[i]["batch-size"]) for i in range(1, 12)] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8]
    assert steps[15]["consumed_samples"] == 84 and steps[30]["consumed_samples"] == 204
    # fp16 from a loss scale of 2^32: the first steps overflow and are skipped, as in Megatron-LM; the scale
    # halves until steps succeed, and the resumed launch continues from the saved scale.
    losses = metrics(f"{tb}/metrics.jsonl", "lm loss")
    assert losses and min(losses) < 30 and 30 in losses
    assert steps[16]["loss-scale"] <= steps[15]["loss-scale"]
    assert "note: --attention-backend auto: accepted" in first
    assert "test split is empty" in first  # --split 949,50,1 on the small corpus: skipped, said once


@pytest.mark.slow
def test_llama3_8b_example_flags_train_stop_and_resume(tmp_path):
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    flags = llama3_8b(str(tmp_path / "cache"), ckpt, tb)
    first, second = _train_stop_resume(flags, ckpt, tb, stop=3, end=6)
    for note in (
        "--use-mcore-models",
        "--manual-gc",
        "--empty-unused-memory-level 1",
        "--sequence-parallel is off",
    ):
        assert note in first, note
    assert "decoupled learning rate:" in second
    assert "--profile without --use-pytorch-profiler" in first  # on the CPU: says it records nothing
