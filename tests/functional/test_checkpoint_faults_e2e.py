"""Issue 23 end to end (pretrain_gpt.py): a save killed with SIGKILL while it replaces the checkpoint the
tracker names, the NaN stop's advice, a full disk, damaged files, another precision, a tracker that is
not text, --load naming one checkpoint, a --save that cannot be written. Each user error is one line."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from launch import ROOT, metrics

from megatron.training import checkpointing
from megatron.training.cli import run
from tests.disk_faults import tmpfs

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0"
).split()


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), err[-3000:]
    return lines[0]


def _losses(path) -> dict[int, float]:
    return {it: r["lm loss"] for it, r in metrics(str(path), "lm loss").items()}


# A child that runs pretrain_gpt.py and SIGKILLs itself while writing its first checkpoint's blocks.
_KILLED_IN_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from megatron.core.dist_checkpointing import torch_dist
original, calls = torch_dist._BlockSavePlanner.resolve_data, []
def resolve_data(self, item):
    calls.append(item)
    if len(calls) == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, item)
torch_dist._BlockSavePlanner.resolve_data = resolve_data
from megatron.training.cli import run
sys.exit(run(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill9_while_resaving_the_tracked_iteration_keeps_it_loadable(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 6 --save {ck} --save-interval 3".split()) == 0
    assert checkpointing.read_tracker(str(ck)) == 6
    # Back to iteration 3, train on, save iteration 6 again over the one the tracker names: killed.
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLED_IN_SAVE.format(root=ROOT),
            *TINY,
            "--train-iters",
            "6",
            "--save",
            str(ck),
            "--load",
            str(ck),
            "--ckpt-step",
            "3",
            "--save-interval",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == -9, child.stderr[-3000:]
    assert "saving checkpoint at iteration       6" in child.stdout
    capsys.readouterr()
    assert (
        run(
            TINY
            + f"--train-iters 8 --save {ck} --load {ck} --override-opt-param-scheduler "
            f"--metrics-file {tmp_path}/m.jsonl".split()
        )
        == 0
    )
    assert f"successfully loaded checkpoint from {ck} at iteration 6" in capsys.readouterr().out
    assert sorted(_losses(tmp_path / "m.jsonl")) == [7, 8]


@pytest.mark.slow
def test_nan_stop_names_a_checkpoint_that_resumes_with_finite_losses(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run(TINY + f"--lr 1e6 --train-iters 10 --save {ck} --save-interval 1".split()) == 3
    line = _one_error_line(capsys.readouterr().err)
    newest = checkpointing.read_tracker(str(ck))
    assert "non-finite gradient norm" in line and f"at iteration {newest + 1}" in line, line
    assert f"computed from the weights of iteration {newest}, which {ck}/iter_{newest:07d} holds" in line, (
        line
    )
    named = int(
        re.search(rf"resume from it with --load {re.escape(str(ck))} --ckpt-step (\d+)", line).group(1)
    )
    assert named < newest
    resume = (
        TINY
        + (
            f"--lr 1e-3 --min-lr 1e-4 --override-opt-param-scheduler --train-iters {named + 4} --load {ck}"
        ).split()
    )
    # The newest checkpoint (the one called intact before) gives the NaN again at once, whatever --lr:
    # its first step is re-run and skipped as a bad batch, the second bad step in a row stops the run.
    assert run(resume + ["--ckpt-step", str(newest)]) == 3
    captured = capsys.readouterr()
    assert f"iteration {newest + 1}: the re-run reproduced it; the batch is skipped" in captured.out
    assert f"at iteration {newest + 2}" in _one_error_line(captured.err)
    assert run(resume + f"--ckpt-step {named} --metrics-file {tmp_path}/m.jsonl".split()) == 0
    curve = _losses(tmp_path / "m.jsonl")
    assert sorted(curve) == list(range(named + 1, named + 5)) and all(map(math.isfinite, curve.values())), (
        curve
    )


def test_a_state_holding_nan_is_not_saved_unless_the_check_is_off(tmp_path, capsys, monkeypatch):
    from megatron.core import dist_checkpointing

    calls = []

    def nan_from_the_second_save(sharded_state_dict, process_group=None):  # as an update that overflowed
        calls.append(1)
        return len(calls) < 2

    monkeypatch.setattr(dist_checkpointing, "all_finite", nan_from_the_second_save)
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 3 --save {ck} --save-interval 1".split()) == 3
    line = _one_error_line(capsys.readouterr().err)
    assert f"at iteration 2 holds NaN or Inf, so {ck}/iter_0000002 was not written" in line, line
    assert f"resume from it with --load {ck} --ckpt-step 1" in line, line
    assert sorted(os.listdir(ck)) == ["iter_0000001", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    calls.clear()
    other = tmp_path / "other"
    assert (
        run(
            TINY
            + f"--train-iters 3 --save {other} --save-interval 1 --no-check-for-nan-in-loss-and-grad".split()
        )
        == 0
    )
    assert checkpointing.read_tracker(str(other)) == 3  # saved, recorded as not finite: a load says so
    assert run(TINY + f"--train-iters 3 --load {other} --ckpt-step 2".split()) == 0
    assert f"warning: {other}/iter_0000002 holds NaN or Inf" in capsys.readouterr().out


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, one_mib_disk, capsys
):
    ck = one_mib_disk / "ck"  # one checkpoint of TINY takes 570 KB: the second does not fit
    argv = TINY + f"--train-iters 3 --save {ck} --save-interval 1 --metrics-file {tmp_path}/m.jsonl".split()
    assert run(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line and f"cannot write checkpoint {ck}" in line, line
    assert f"removed the partial {ck}/iter_0000002.saving" in line and "still names iteration 1" in line, line
    assert sorted(os.listdir(ck)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert run(TINY + f"--train-iters 3 --load {ck}".split()) == 0
    assert f"successfully loaded checkpoint from {ck} at iteration 1" in capsys.readouterr().out


@pytest.mark.slow
def test_damaged_checkpoint_files_are_named_with_the_checkpoint_to_load_instead(tmp_path, capsys):
    pristine, ck = tmp_path / "pristine", tmp_path / "ck"
    assert run(TINY + f"--train-iters 4 --save {pristine} --save-interval 2".split()) == 0
    for name, damage, says in (
        ("__0_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) // 2), "is truncated"),
        ("__0_0.distcp", os.remove, "is missing"),
        (".metadata", os.remove, "is missing"),
    ):
        shutil.rmtree(ck, ignore_errors=True)
        shutil.copytree(pristine, ck)
        damage(ck / "iter_0000004" / name)
        capsys.readouterr()
        assert run(TINY + f"--train-iters 4 --load {ck}".split()) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"{ck}/iter_0000004/{name} {says}" in line and "--ckpt-step 2" in line, line


def test_fp32_checkpoint_resumed_with_bf16_tracker_bytes_and_iteration_dir(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert run(TINY + f"--train-iters 3 --save {ck} --exit-interval 2".split()) == 0
    capsys.readouterr()
    # another precision: say which flag differs and what to do
    assert run(TINY + f"--train-iters 3 --load {ck} --bf16".split()) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "fp32 (neither --bf16 nor --fp16)" in line and "this run trains in bf16 (--bf16)" in line, line
    assert "resume without --bf16 to load it, or pass --no-load-optim" in line, line
    assert run(TINY + f"--train-iters 3 --load {ck} --bf16 --no-load-optim".split()) == 0
    # --load naming one checkpoint loads it (Megatron users pass it), instead of starting from scratch
    capsys.readouterr()
    assert run(TINY + f"--train-iters 3 --load {ck}/iter_0000002".split()) == 0
    out = capsys.readouterr().out
    assert (
        f"successfully loaded checkpoint from {ck} at iteration 2" in out
        and "starting from scratch" not in out
    )
    # a tracker that is not text: the file is named
    (ck / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe2")
    assert run(TINY + f"--train-iters 3 --load {ck}".split()) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{ck}/latest_checkpointed_iteration.txt is not text" in line, line


def test_save_that_cannot_be_written_fails_before_training(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory")
    assert run(TINY + f"--train-iters 3 --save {tmp_path}/a_file".split()) == 2
    assert f"--save {tmp_path}/a_file is a file, not a directory" in _one_error_line(capsys.readouterr().err)
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mounted:
        if not mounted:
            if os.geteuid() == 0:
                pytest.skip("root without the right to mount: no read-only directory to test with")
            os.chmod(tmp_path / "ro", 0o555)
        assert run(TINY + f"--train-iters 3 --save {tmp_path}/ro/ck".split()) == 2
        captured = capsys.readouterr()
        assert f"--save {tmp_path}/ro/ck cannot be created: {tmp_path}/ro is not writable" in _one_error_line(
            captured.err
        )
        assert "training from iteration" not in captured.out  # stopped at the start
