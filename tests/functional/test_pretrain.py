"""pretrain_gpt.py end to end on the CPU: training, evaluation, checkpoints, resume, exits, errors."""

import json
import os
import subprocess
import sys

import pytest
from launch import ROOT, metrics, torchrun

from megatron.training import checkpointing
from megatron.training.cli import run

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 2"
).split()


def losses(path: str) -> dict[int, float]:
    """Iteration -> training loss from a metrics JSONL file."""
    return {it: r["lm loss"] for it, r in metrics(path, "lm loss").items()}


def test_trains_evaluates_and_logs(tmp_path, capsys):
    tb = tmp_path / "tb"
    rc = run(TINY + f"--train-iters 30 --eval-interval 15 --tensorboard-dir {tb}".split())
    assert rc == 0
    out = capsys.readouterr().out
    assert "validation loss at iteration 15 | lm loss value:" in out and "lm loss PPL:" in out
    assert "iteration 30 on test set" in out
    line = next(ln for ln in out.splitlines() if "iteration       30/      30" in ln)
    for field in (
        "consumed samples:          120",
        "elapsed time per iteration (ms):",
        "throughput per GPU (TFLOP/s/GPU):",
        "tokens per second per GPU:",
        "MFU: n/a",
        "learning rate:",
        "global batch size:     4",
        "lm loss:",
        "loss scale: 1.0",
        "grad norm:",
        "number of skipped iterations:   0",
        "number of nan iterations:   0",
    ):
        assert field in line, field
    curve = losses(str(tb / "metrics.jsonl"))
    assert len(curve) == 30 and curve[30] < curve[1] - 0.5
    # Every step's time is measured when it finished, though the loop queues the next one first.
    times = [r["iteration-time"] for r in metrics(str(tb / "metrics.jsonl"), "iteration-time").values()]
    assert len(times) == 30 and min(times) > 1e-3  # seconds; a step of this model takes tens of ms
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    assert "lm loss validation" in open(tb / "metrics.jsonl").read()


@pytest.mark.slow
def test_overfits_fixed_batch(tmp_path, capsys):
    """One 65-token document: every sample is the same window, so the loss must collapse."""
    import numpy as np

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "one_doc")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    builder.add_document(rng.integers(0, 127, size=65).astype(np.uint16), [65])
    builder.finalize(prefix + ".idx")
    argv = [a for a in TINY if a != "--mock-data"] + (
        f"--train-data-path {prefix} --valid-data-path {prefix} --test-data-path {prefix} "
        f"--tokenizer-type NullTokenizer --hidden-dropout 0 --attention-dropout 0 --train-iters 60 "
        f"--eval-interval 60 --metrics-file {tmp_path}/m.jsonl --lr 1e-2 --weight-decay 0"
    ).split()
    assert run(argv) == 0
    curve = losses(f"{tmp_path}/m.jsonl")
    assert curve[1] > 4.0 and curve[60] < 0.5, (curve[1], curve[60])
    assert "validation loss at iteration 60" in capsys.readouterr().out


@pytest.mark.slow
def test_exact_resume_is_bitwise(tmp_path):
    common = TINY + "--hidden-dropout 0.1 --attention-dropout 0.1 --train-iters 20 --eval-interval 5".split()
    assert run(common + f"--metrics-file {tmp_path}/straight.jsonl".split()) == 0
    ck = tmp_path / "ck"
    assert (
        run(
            common
            + f"--save {ck} --save-interval 10 --exit-interval 10 --metrics-file {tmp_path}/a.jsonl".split()
        )
        == 0
    )
    assert checkpointing.read_tracker(str(ck)) == 10
    assert (
        run(common + f"--save {ck} --load {ck} --save-interval 10 --metrics-file {tmp_path}/a.jsonl".split())
        == 0
    )
    straight, resumed = losses(f"{tmp_path}/straight.jsonl"), losses(f"{tmp_path}/a.jsonl")
    assert sorted(resumed) == list(range(1, 21))
    assert straight == resumed  # bitwise: floats compared exactly


def test_save_load_same_dir_first_launch_starts_fresh(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 3 --save {ck} --load {ck}".split()) == 0
    out = capsys.readouterr().out
    assert f"no checkpoint found in {ck}" in out and "starting from scratch" in out
    assert checkpointing.read_tracker(str(ck)) == 3


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 4 --save {ck} --save-interval 2".split()) == 0
    assert checkpointing.read_tracker(str(ck)) == 4

    real_save = checkpointing.dist_checkpointing.save

    def dies_half_way(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", dies_half_way)
    # An interrupt (a second Ctrl-C) ends the run with 130 and one line, wherever it lands.
    assert (
        run(
            TINY
            + f"--train-iters 6 --save {ck} --load {ck} --save-interval 2 "
            "--override-opt-param-scheduler".split()
        )
        == 130
    )
    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", real_save)
    assert checkpointing.read_tracker(str(ck)) == 4
    assert run(TINY + f"--train-iters 6 --save {ck} --load {ck} --override-opt-param-scheduler".split()) == 0
    assert checkpointing.read_tracker(str(ck)) == 6


def test_bad_load_and_shape_mismatch(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 3 --save {ck}".split()) == 0
    capsys.readouterr()
    assert run(TINY + f"--train-iters 4 --load {ck} --hidden-size 64".split()) == 2
    err = capsys.readouterr().err
    assert "--hidden-size: checkpoint 32 vs current 64" in err and "Traceback" not in err
    (ck / "latest_checkpointed_iteration.txt").write_text("7")
    assert run(TINY + f"--train-iters 4 --load {ck}".split()) == 2
    err = capsys.readouterr().err
    assert "iter_0000007" in err and "Traceback" not in err


def _field(line: str, name: str) -> float:
    return float(line.split(f"{name}: ")[1].split(" |")[0])


def test_fp16_overflow_steps_are_skipped_and_counted(capsys):
    # A scale of 1e36 overflows fp32 loss * scale: every step is skipped and the scale halves
    # (hysteresis 1); parameters, and so the loss, do not move.
    assert (
        run(TINY + "--train-iters 3 --fp16 --initial-loss-scale 1e36 --hysteresis 1 --eval-iters 0".split())
        == 0
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln and "/       3" in ln]
    assert len(lines) == 3
    for i, line in enumerate(lines, start=1):
        assert "number of skipped iterations:   1" in line and "grad norm" not in line
        assert _field(line, "loss scale") == pytest.approx(1e36 / 2**i)
    # A sane scale trains normally in fp16.
    assert run(TINY + "--train-iters 3 --fp16 --initial-loss-scale 4096 --eval-iters 0".split()) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln and "/       3" in ln]
    assert all("number of skipped iterations:   0" in ln for ln in lines)
    assert _field(lines[-1], "lm loss") < _field(lines[0], "lm loss")


def test_bf16_trains(tmp_path):
    assert run(TINY + f"--train-iters 6 --bf16 --metrics-file {tmp_path}/m.jsonl".split()) == 0
    curve = losses(f"{tmp_path}/m.jsonl")
    assert curve[6] < curve[1]


@pytest.mark.slow
def test_user_error_exit_code_in_a_real_process():
    cmd = [
        sys.executable,
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY,
        "--train-iters",
        "2",
        "--global-batch-size",
        "3",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --global-batch-size 3 is not divisible by --micro-batch-size 2 x data-parallel "
        "size 1; use e.g. --global-batch-size 4"
    ]


def test_dry_run_reports_parameters_without_training(tmp_path, capsys):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert run(TINY + f"--train-iters 5 --dry-run --save {tmp_path}/ck".split()) == 0
    out = capsys.readouterr().out
    real = GPTModel(
        TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            bias_gelu_fusion=True,
            share_embeddings_and_output_weights=True,
        ),
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
    )
    assert f"parameters: {sum(p.numel() for p in real.parameters()):,}" in out
    assert "total (estimate)" in out and "model FLOPs per step" in out
    assert " iteration " not in out and not (tmp_path / "ck").exists()


def test_dry_run_of_an_uneven_interleaved_pipeline_counts_every_layer(monkeypatch, capsys):
    """26 layers as 6 / 8 / 8 / 4 over 4 pipeline ranks with 2 virtual stages each (8 processes): the
    dry run builds the whole model in one process and counts the same parameters as the even split."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert TINY[:2] == ["--num-layers", "2"]
    shape = ["--num-layers", "26"] + TINY[2:] + "--train-iters 5 --dry-run".split()
    assert (
        run(
            shape
            + (
                "--pipeline-model-parallel-size 4 --global-batch-size 16 --virtual-pipeline-model-parallel-size 2 "
                "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4"
            ).split()
        )
        == 0
    )
    uneven = capsys.readouterr().out
    assert "configuration is valid for 8 process(es)" in uneven
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert run(shape) == 0
    even = capsys.readouterr().out
    count = [ln for ln in even.splitlines() if "parameters:" in ln]
    assert count and count[0] in uneven


def test_dry_run_counts_bf16_gradients_with_grad_reduce_in_bf16(capsys):
    assert TINY[:6] == ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    shape = (
        "--num-layers 8 --hidden-size 1024 --num-attention-heads 8".split() + TINY[6:]
    )  # ~100 M params (meta)

    def gradient_gib(extra: str) -> float:
        assert run(shape + f"--train-iters 5 --dry-run --bf16 {extra}".split()) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if "gradients memory" in ln)
        return float(line.split()[2])

    fp32, bf16 = gradient_gib(""), gradient_gib("--grad-reduce-in-bf16")
    assert fp32 > 0.1 and abs(bf16 - fp32 / 2) <= 0.01  # printed with two decimals


def test_exit_duration(capsys):
    assert run(TINY + "--train-iters 50 --exit-duration-in-mins 0".split()) == 0
    out = capsys.readouterr().out
    assert "exiting after 0.0 minutes (--exit-duration-in-mins)" in out
    # Seen after step 1; step 2 was already queued behind it (the loop runs one step ahead), so the
    # run stops after step 2.
    assert "iteration        2/" in out and "iteration        3/" not in out


@pytest.mark.slow
def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="install the wandb extra: pip install -e .[wandb]")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert (
        run(
            TINY
            + f"--train-iters 3 --wandb-project demo --wandb-exp-name t --wandb-save-dir {tmp_path}".split()
        )
        == 0
    )
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    files = os.listdir(tmp_path / "wandb" / runs[0])
    assert any(f.endswith(".wandb") for f in files)


@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path):
    """Data parallelism over two gloo processes trains the same model as one process."""
    args = TINY + "--train-iters 4 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0".split()
    assert run(args + f"--metrics-file {tmp_path}/one.jsonl".split()) == 0
    torchrun(2, args + ["--metrics-file", f"{tmp_path}/two.jsonl"], timeout=300)
    one, two = losses(f"{tmp_path}/one.jsonl"), losses(f"{tmp_path}/two.jsonl")
    assert sorted(two) == [1, 2, 3, 4]
    for it in one:
        assert two[it] == pytest.approx(one[it], rel=1e-5, abs=1e-6)


def test_divergence_stops_before_saving(tmp_path, capsys):
    """A NaN gradient norm stops the run (exit 3, one line) before the poisoned weights are saved."""
    ck = tmp_path / "ck"
    argv = (
        TINY
        + f"--train-iters 10 --lr 1e30 --lr-warmup-iters 0 --clip-grad 0 --save {ck} --save-interval 1".split()
    )
    assert run(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite gradient norm" in err[0]
    it = checkpointing.read_tracker(str(ck))
    assert it is not None and f"iteration {it + 1}" in err[0]
    # The newest checkpoint holds the weights the NaN came from: it is named as such, never as intact.
    assert f"which {ck}/iter_{it:07d} holds (resuming from it repeats this)" in err[0]
    assert it > 1 or "start again from scratch" in err[0]
    capsys.readouterr()
    assert (
        run(
            argv
            + ["--no-check-for-nan-in-loss-and-grad", "--train-iters", "3", "--save", str(tmp_path / "b")]
        )
        == 0
    )


def test_pytorch_profiler_writes_trace_and_summary(tmp_path, capsys):
    prof = tmp_path / "prof"
    argv = (
        TINY
        + (
            f"--train-iters 4 --eval-iters 0 --profile --use-pytorch-profiler --profile-step-start 2 "
            f"--profile-step-end 4 --profile-dir {prof}"
        ).split()
    )
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "profile of iterations 2-3 (rank 0)" in out
    assert (prof / "trace_rank0.json").stat().st_size > 1000
    assert (prof / "kernels_rank0.txt").read_text().startswith("GPU kernel time per step")
    breakdown = json.loads((prof / "breakdown_rank0.json").read_text())
    assert set(breakdown) == {
        "kernel_ms",
        "by_category_ms",
        "idle_ms",
        "communication_ms",
        "exposed_communication_ms",
        "exposed_pipeline_wait_ms",
        "host_ops_ms",
    }
    assert breakdown["exposed_pipeline_wait_ms"] == 0.0  # one process: no pipeline
    # the training thread's operators on the host (a CPU run: all of its work)
    assert breakdown["host_ops_ms"] and breakdown["host_ops_ms"][0] > 0
    assert "host time in operators per step" in (prof / "kernels_rank0.txt").read_text()


def test_profile_step_range_must_be_nonempty(tmp_path, capsys):
    rc = run(TINY + "--train-iters 4 --profile --profile-step-start 3 --profile-step-end 3".split())
    assert rc == 2
    assert "--profile-step-end (3) must be greater than --profile-step-start (3)" in capsys.readouterr().err


def test_log_num_zeros_in_grad(capsys):
    assert run(TINY + "--train-iters 3 --eval-iters 0 --log-num-zeros-in-grad".split()) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln and "/       3" in ln]
    assert len(lines) == 3
    for line in lines:
        zeros = _field(line, "num zeros")
        assert line.index("grad norm:") < line.index("num zeros:") and 0.0 <= zeros < 1e6


def test_bad_lr_schedule_fails_before_the_model_is_built(capsys):
    assert run(TINY + "--train-iters 2".split()) == 2  # TINY warms up for 2 iterations: longer than the run
    captured = capsys.readouterr()
    assert "LR warm-up (8 samples" in captured.err and "Traceback" not in captured.err
    assert "number of parameters" not in captured.out and "> kernels" not in captured.out
