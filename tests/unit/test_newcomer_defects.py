"""Issue 22's newcomer defects and the smaller Megatron-LM flags implemented with it, one test each."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.training.arguments import parse_run_config
from megatron.training.cli import run
from megatron.training.config import DataConfig, LoggerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--lr 1e-3 --mock-data --num-workers 0"
).split()


def test_dry_run_takes_world_size_from_the_flag_and_pads_the_vocabulary_for_its_tp_size(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = MODEL + "--train-iters 2 --vocab-size 50257 --tensor-model-parallel-size 2 --dry-run".split()
    assert run(argv + ["--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "configuration is valid for 8 process(es)" in out
    assert "padded vocabulary 50432" in out  # 128 x tp2, as the real tp2 run pads it (50304 would be tp1's)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run(argv) == 0
    assert "configuration is valid for 4 process(es)" in capsys.readouterr().out
    # A world size that does not divide the layout is named before anything else happens.
    assert run(argv + ["--world-size", "3"]) == 2
    assert "world size 3 is not divisible by --tensor-model-parallel-size 2" in capsys.readouterr().err


def test_world_size_of_a_real_run_must_match_the_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="--world-size 8 differs from the 1 process"):
        parse_run_config(MODEL + "--train-iters 2 --vocab-size 128 --world-size 8".split())


def test_missing_lr_is_one_clear_error():
    with pytest.raises(ValueError, match=r"--lr is required \(e.g. --lr 3e-4\)"):
        parse_run_config(
            [a for a in MODEL if a not in ("--lr", "1e-3")] + "--train-iters 2 --vocab-size 128".split()
        )


def test_throughput_on_a_cpu_is_shown_not_rounded_to_zero():
    from megatron.training.metrics import format_iteration_line

    record = {
        "consumed-samples": 2,
        "iteration-time": 0.07,
        "throughput": 0.000621,
        "tokens-per-sec-per-gpu": 900.0,
        "learning-rate": 1e-3,
        "batch-size": 2,
        "lm loss": 4.8,
        "loss-scale": 1.0,
        "grad-norm": 1.0,
        "params-norm": 12.5,
        "skipped-iterations": 0,
        "nan-iterations": 0,
    }
    line = format_iteration_line(1, 2, record)
    assert "throughput per GPU (TFLOP/s/GPU): 0.000621 |" in line and "MFU: n/a" in line
    assert "grad norm: 1.000 | params norm: 12.500 |" in line
    assert "TFLOP/s/GPU): 312.4 |" in format_iteration_line(1, 2, {**record, "throughput": 312.44})


def test_profile_without_the_pytorch_profiler_on_a_cpu_says_it_records_nothing(capsys):
    from megatron.training.profiling import StepProfiler

    StepProfiler(LoggerConfig(profile=True), 0, torch.device("cpu"), None)
    assert "--profile without --use-pytorch-profiler" in capsys.readouterr().out
    StepProfiler(LoggerConfig(profile=True, use_pytorch_profiler=True), 0, torch.device("cpu"), None)
    assert capsys.readouterr().out == ""


def test_no_triton_warnings_when_triton_is_not_installed(tmp_path):
    """The README's CPU command installs no Triton: importing the kernels must not log torch's
    "Triton not available" once per op."""
    (tmp_path / "triton.py").write_text("raise ImportError('no triton here')\n")
    code = "import megatron.core.fusions.triton_kernels as k; assert k.triton is None; print('imported')"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert res.returncode == 0 and "imported" in res.stdout, res.stderr[-2000:]
    assert "Triton not available" not in res.stderr


def test_query_group_hint_satisfies_the_tensor_parallel_rule_too():
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="must divide num_attention_heads 32; e.g. 8") as e:
        TransformerConfig(
            num_layers=2,
            hidden_size=256,
            num_attention_heads=32,
            num_query_groups=3,
            tensor_model_parallel_size=8,
        )
    hint = int(str(e.value).rsplit(" ", 1)[1])
    TransformerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=32,
        num_query_groups=hint,
        tensor_model_parallel_size=8,
    )  # the hint passes every rule


def test_data_paths_from_files(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n0.7 /data/b_text_document\n")
    assert DataConfig(data_args_path=str(blend)).data_path == [
        "0.3",
        "/data/a_text_document",
        "0.7",
        "/data/b_text_document",
    ]
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": "1 /data/a", "valid": ["/data/v"], "test": None}))
    cfg = DataConfig(per_split_data_args_path=str(splits))
    assert (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path) == (
        ["1", "/data/a"],
        ["/data/v"],
        None,
    )
    with pytest.raises(ValueError, match="--data-args-path .*missing.txt: cannot read it"):
        DataConfig(data_args_path=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="give --data-path or --data-args-path, not both"):
        DataConfig(data_args_path=str(blend), data_path=["x"])
    splits.write_text("[1, 2]")
    with pytest.raises(ValueError, match="give an object with a 'train' key"):
        DataConfig(per_split_data_args_path=str(splits))


def test_logging_flags_of_megatron_lm(tmp_path, capsys):
    """--log-params-norm, --log-progress, --log-world-size-to-tensorboard,
    --no-log-loss-scale-to-tensorboard and --start-eval-at-iter in one short run."""
    metrics = tmp_path / "m.jsonl"
    argv = (
        MODEL
        + (
            f"--train-iters 4 --vocab-size 128 --log-interval 1 --eval-interval 1 --eval-iters 1 "
            f"--start-eval-at-iter 3 --save {tmp_path}/ck --save-interval 2 --metrics-file {metrics} "
            "--log-params-norm --log-progress --log-world-size-to-tensorboard "
            "--no-log-loss-scale-to-tensorboard"
        ).split()
    )
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert out.count("params norm: ") == 4
    assert "validation loss at iteration 2 " not in out
    assert "validation loss at iteration 3 " in out and "validation loss at iteration 4 " in out
    records = [json.loads(line) for line in open(metrics)]
    train = [r for r in records if "lm loss" in r]
    assert train and all(
        r["world-size"] == 1.0 and "loss-scale" not in r and r["params-norm"] > 0 for r in train
    )
    progress = (tmp_path / "ck" / "progress.txt").read_text().splitlines()
    assert len(progress) == 3 and "starting job" in progress[0]
    assert (
        "saved checkpoint" in progress[1] and "iteration: 2" in progress[1] and "tokens: 128" in progress[1]
    )
    assert "iteration: 4" in progress[2]


def test_exit_signal_chooses_the_signal_the_handler_saves_on():
    import signal

    from megatron.training.loop_utils import DistributedSignalHandler

    cfg = parse_run_config(
        MODEL
        + "--train-iters 2 --vocab-size 128 --save /tmp/x --exit-signal-handler --exit-signal SIGUSR1".split()
    )
    handler = DistributedSignalHandler((getattr(signal, cfg.training.exit_signal), signal.SIGINT))
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1
    finally:
        handler.release()
    assert (
        parse_run_config(MODEL + "--train-iters 2 --vocab-size 128".split()).training.exit_signal == "SIGTERM"
    )
