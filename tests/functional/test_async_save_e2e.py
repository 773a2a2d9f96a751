"""--async-save end to end (pretrain_gpt.py): the same losses and checkpoint contents as a synchronous
save, retention once a newer checkpoint is complete, a failed background write as one line, and a kill
-9 or a SIGTERM while the files are being written.

The kill and SIGTERM tests block the background write deterministically: the child process replaces
the save planner's ``resolve_data`` (as tests/disk_faults.py replaces the file writer) so that the write
of one checkpoint waits, in the writer thread, until the test lets it go (or kills the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
from launch import ROOT, metrics

from megatron.training import checkpointing
from megatron.training.checkpoint_tool.reader import SavedCheckpoint
from megatron.training.cli import run

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0"
).split()
# Config fields that differ between the two runs compared, by design.
DIFFERENT = {
    "checkpoint": ("async_save", "ckpt_keep_last", "save_retain_interval", "save"),
    "logger": ("metrics_file",),
}


def _checkpoints(path) -> list[str]:
    """The checkpoint directories of a save directory and its tracker (not its metrics file)."""
    return sorted(n for n in os.listdir(path) if n != "metrics.jsonl")


def _losses(path) -> dict[int, float]:
    return {it: r["lm loss"] for it, r in metrics(str(path), "lm loss").items()}


def _common(ck: SavedCheckpoint) -> dict:
    common = dict(ck.common)
    args = dict(common.pop("args"))
    config = {k: dict(v) for k, v in args.pop("config").items()}
    for section, fields in DIFFERENT.items():
        for field in fields:
            config[section].pop(field)
    return {**common, "args": {**args, "config": config}}


def _assert_same_checkpoint(a: SavedCheckpoint, b: SavedCheckpoint) -> None:
    assert a.tensors == b.tensors and a.objects == b.objects
    for key in a.tensors:
        assert torch.equal(a.read(key), b.read(key)), key
    for key in set(a.objects) - {"common_state"}:  # the common values are compared below
        assert repr(a.read_object(key)) == repr(b.read_object(key)), key
    assert _common(a) == _common(b)


def test_async_save_matches_sync_and_retention_waits_for_the_newer_checkpoint(tmp_path, capsys):
    runs = {
        "sync": "--save-retain-interval 4",  # after 4: 2 goes (not a multiple of 4); after 6: 4 stays
        "async": "--async-save --ckpt-keep-last 2",  # after 6: 2 goes
    }
    out = {}
    for name, flags in runs.items():
        argv = f"--train-iters 6 --save {tmp_path / name} --save-interval 2 --metrics-file {tmp_path}/{name}.jsonl"
        assert run(TINY + argv.split() + flags.split()) == 0
        out[name] = capsys.readouterr().out
    assert _losses(tmp_path / "sync.jsonl") == _losses(tmp_path / "async.jsonl")
    for name in runs:
        assert _checkpoints(tmp_path / name) == [
            "iter_0000004",
            "iter_0000006",
            "latest_checkpointed_iteration.txt",
        ]
    for it in (4, 6):
        _assert_same_checkpoint(
            SavedCheckpoint(str(tmp_path / "sync"), it), SavedCheckpoint(str(tmp_path / "async"), it)
        )
    sync, done = out["sync"], "successfully saved checkpoint from iteration {:7d}"
    deleted = f"  deleted checkpoint {tmp_path}/sync/iter_0000002 (--save-retain-interval 4: 2 is not a multiple of it)"
    assert sync.index(done.format(4)) < sync.index(deleted) < sync.index(done.format(6)), sync[-3000:]
    asy = out["async"]
    deleted = f"  deleted checkpoint {tmp_path}/async/iter_0000002 (--ckpt-keep-last 2)"
    assert asy.index(done.format(6)) < asy.index(deleted), asy[-3000:]
    assert asy.count("deleted checkpoint") == 1 and "asynchronous save of iteration       2 started" in asy
    assert asy.count("(asynchronous: written in the background)") == 3 and "training stalled" in asy


def test_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, one_mib_disk, capsys
):
    ck = one_mib_disk / "ck"  # one checkpoint of TINY takes 570 KB: the second does not fit
    assert run(TINY + f"--train-iters 3 --save {ck} --save-interval 1 --async-save".split()) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), lines
    line = lines[0]
    assert "No space left on device" in line and f"cannot write checkpoint {ck}" in line, line
    assert f"removed the partial {ck}/iter_0000002.saving" in line and "still names iteration 1" in line, line
    assert _checkpoints(ck) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


# A child that runs pretrain_gpt.py; the background write of save number BLOCKED_SAVE (1-based) writes
# the file MARK, then waits until the file GO exists.
_BLOCKED_WRITE = """
import os, sys, time
sys.path.insert(0, {root!r})
from megatron.core.dist_checkpointing import torch_dist
mark, go, blocked = {mark!r}, {go!r}, {blocked}
set_up, resolve, saves = torch_dist._BlockSavePlanner.set_up_planner, torch_dist._BlockSavePlanner.resolve_data, []
def set_up_planner(self, *args, **kwargs):
    saves.append(1)
    self.blocked = len(saves) == blocked
    return set_up(self, *args, **kwargs)
def resolve_data(self, item):
    if self.blocked:
        self.blocked = False
        open(mark, "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
    return resolve(self, item)
torch_dist._BlockSavePlanner.set_up_planner = set_up_planner
torch_dist._BlockSavePlanner.resolve_data = resolve_data
from megatron.training.cli import run
sys.exit(run(sys.argv[1:]))
"""


def _start_blocked(tmp_path, blocked: int, flags: str) -> subprocess.Popen:
    script = _BLOCKED_WRITE.format(
        root=ROOT, mark=str(tmp_path / "mark"), go=str(tmp_path / "go"), blocked=blocked
    )
    return subprocess.Popen(
        [sys.executable, "-u", "-c", script, *TINY, *flags.split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 120.0) -> str:
    seen, deadline = [], time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} not seen:\n" + "".join(seen)[-3000:])


def test_kill9_during_an_async_save_leaves_the_previous_checkpoint_latest(tmp_path, capsys):
    ck = tmp_path / "ck"
    proc = _start_blocked(tmp_path, 2, f"--train-iters 6 --save {ck} --save-interval 2 --async-save")
    try:
        seen = _read_until(proc, "asynchronous save of iteration       4 started")
        seen += _read_until(proc, "iteration        5/")  # training went on while iteration 4 was written
        assert (tmp_path / "mark").exists(), seen[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "successfully saved checkpoint from iteration       4" not in seen
    assert checkpointing.read_tracker(str(ck)) == 2
    assert _checkpoints(ck) == ["iter_0000002", "iter_0000004.saving", "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    # resumed with --ckpt-keep-last 1: the checkpoint it loaded goes only once a newer one is complete
    argv = f"--train-iters 6 --save {ck} --load {ck} --save-interval 2 --async-save --ckpt-keep-last 1"
    assert run(TINY + argv.split() + ["--metrics-file", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"successfully loaded checkpoint from {ck} at iteration 2" in out
    assert (
        out.index("successfully saved checkpoint from iteration       4")
        < out.index(f"deleted checkpoint {ck}/iter_0000002 (--ckpt-keep-last 1)")
        < out.index("successfully saved checkpoint from iteration       6")
        < out.index(f"deleted checkpoint {ck}/iter_0000004 (--ckpt-keep-last 1)")
    ), out[-3000:]
    assert sorted(_losses(tmp_path / "m.jsonl")) == [3, 4, 5, 6]
    assert checkpointing.read_tracker(str(ck)) == 6
    assert _checkpoints(ck) == ["iter_0000006", "latest_checkpointed_iteration.txt"]


def test_sigterm_during_an_async_save_waits_for_it_saves_and_exits_0(tmp_path):
    ck = tmp_path / "ck"
    flags = f"--train-iters 100000 --save {ck} --save-interval 2 --async-save --exit-signal-handler"
    proc = _start_blocked(tmp_path, 1, flags)
    try:
        seen = _read_until(proc, "asynchronous save of iteration       2 started")
        deadline = time.monotonic() + 60
        while not (tmp_path / "mark").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the write of iteration 2 is in flight, held
        time.sleep(1.0)
        (tmp_path / "go").touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = seen + out
    assert proc.returncode == 0 and "exiting on SIGTERM" in out, out[-3000:]
    assert "waited " in out and "for the asynchronous save of iteration       2 to finish" in out, out[-3000:]
    last = checkpointing.read_tracker(str(ck))
    assert last is not None and last > 2, out[-3000:]
    assert f"successfully saved checkpoint from iteration {last:7d}" in out
    for it in range(2, last + 1, 2):
        assert SavedCheckpoint(str(ck), it).iteration == it
    assert SavedCheckpoint(str(ck)).iteration == last
