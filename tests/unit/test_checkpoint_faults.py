"""Issue 23, checkpoints: nothing lost, nothing silent. A kill -9 at any point of a (re-)save, a full
disk, damaged files, non-finite weights, another precision, a bad tracker, --load naming one checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import CheckpointReadError, CheckpointWriteError, ShardedTensor
from megatron.core.dist_checkpointing import torch_dist as dcp_backend
from megatron.training import checkpoint_advice, checkpoint_dirs
from megatron.training import checkpointing as ckpt
from tests.disk_faults import tmpfs

QUIET = {"log": lambda _: None}


class Optimizer:
    """Duck-typed optimizer: one moment per parameter (plus an fp32 copy, as --bf16 keeps, if asked)."""

    def __init__(self, model: nn.Module, main_params: bool = False) -> None:
        self.state = {n: torch.full_like(p, 0.5, dtype=torch.float32) for n, p in model.named_parameters()}
        self.main = (
            {n: p.detach().float().clone() for n, p in model.named_parameters()} if main_params else {}
        )

    def sharded_state_dict(self, model_sd: dict) -> dict:
        out = {
            f"m.{n}": ShardedTensor(f"optimizer.exp_avg.{n}", t, tuple(t.shape), (0,) * t.dim())
            for n, t in self.state.items()
        }
        out.update(
            {
                f"p.{n}": ShardedTensor(f"optimizer.fp32_param.{n}", t, tuple(t.shape), (0,) * t.dim())
                for n, t in self.main.items()
            }
        )
        return out

    def load_sharded_state_dict(self, sd: dict) -> None:
        pass


def _model(width: int = 8, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(width, 4).to(dtype)


def _sd(model: nn.Module) -> dict:
    return {n: ShardedTensor(n, p, tuple(p.shape), (0,) * p.dim()) for n, p in model.named_parameters()}


def _save(root, iteration: int, model: nn.Module, **kw) -> None:
    ckpt.save_checkpoint(
        str(root),
        iteration,
        _sd(model),
        Optimizer(model),
        extra_state={"iteration": iteration},
        **{**QUIET, **kw},
    )


def _load(root, model: nn.Module, **kw) -> dict | None:
    return ckpt.load_checkpoint(str(root), _sd(model), Optimizer(model), **{**QUIET, **kw})


def _weight(model: nn.Module) -> torch.Tensor:
    return model.weight.detach().clone()


# ------------------------------------------------------------------------------------------------
# 1. kill -9 while (re-)saving the iteration the tracker names


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_while_writing() -> None:
    original = dcp_backend._BlockSavePlanner.resolve_data
    calls = []

    def resolve_data(self, item):
        calls.append(item)
        if len(calls) == 2:  # the first block is written, the second never
            _kill_self()
        return original(self, item)

    dcp_backend._BlockSavePlanner.resolve_data = resolve_data


def _kill_after_rename(n: int) -> None:
    original, calls = checkpoint_dirs._rename, []

    def rename(src: str, dst: str) -> None:
        original(src, dst)
        calls.append(dst)
        if len(calls) == n:
            _kill_self()

    checkpoint_dirs._rename = rename


KILL_POINTS = {
    "while-writing": _kill_while_writing,  # before the fix, the old checkpoint was deleted before this
    "between-renames": lambda: _kill_after_rename(1),  # the old one set aside, the new one complete beside it
    "before-removing-the-old": lambda: _kill_after_rename(2),  # the new one in place, the old one still aside
}


def _resave_and_die(root: str, point: str) -> None:
    """A spawned process (no finally blocks, no teardown once killed): save iteration 6 again with the
    weights + 1 and SIGKILL itself at ``point``."""
    KILL_POINTS[point]()
    model = _model()
    with torch.no_grad():
        model.weight.add_(1.0)
    _save(root, 6, model)


@pytest.mark.parametrize(
    "point, loads", [("while-writing", "old"), ("between-renames", "new"), ("before-removing-the-old", "new")]
)
def test_kill_during_resave_leaves_a_complete_checkpoint(tmp_path, point, loads):
    model = _model()
    _save(tmp_path, 6, model)
    old = _weight(model)
    child = mp.get_context("spawn").Process(target=_resave_and_die, args=(str(tmp_path), point))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    assert ckpt.read_tracker(str(tmp_path)) == 6

    fresh = _model()
    with torch.no_grad():
        fresh.weight.zero_()
    assert _load(tmp_path, fresh)["iteration"] == 6
    torch.testing.assert_close(_weight(fresh), old if loads == "old" else old + 1.0, rtol=0, atol=0)
    # repaired by the load: no .replaced left (a partial .saving of the killed write may stay)
    assert set(os.listdir(tmp_path)) - {"iter_0000006.saving"} == {
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    }
    _save(tmp_path, 6, model)  # the next save of the iteration clears what the killed one left
    assert sorted(os.listdir(tmp_path)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]


def test_load_reads_a_set_aside_checkpoint_it_cannot_rename(tmp_path, monkeypatch):
    model = _model()
    _save(tmp_path, 6, model)
    os.rename(tmp_path / "iter_0000006", tmp_path / "iter_0000006.replaced")  # as a kill between the renames
    lines: list[str] = []

    def read_only(src: str, dst: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(checkpoint_dirs, "_rename", read_only)
    assert ckpt.load_checkpoint(str(tmp_path), _sd(_model()), log=lines.append)["iteration"] == 6
    assert any("reading it there" in line for line in lines)


# ------------------------------------------------------------------------------------------------
# 2. non-finite weights are recorded, refused on request, and never named as a checkpoint to resume from


def test_non_finite_state_is_recorded_refused_and_skipped(tmp_path):
    model = _model()
    _save(tmp_path, 1, model)
    _save(tmp_path, 2, model)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(ckpt.NonFiniteStateError, match="iteration 3 holds NaN or Inf"):
        _save(tmp_path, 3, model, require_finite=True)
    assert not any(name.startswith("iter_0000003") for name in os.listdir(tmp_path))
    _save(tmp_path, 3, model)  # without require_finite: saved, recorded as not finite
    lines: list[str] = []
    _load(tmp_path, _model(), log=lines.append)
    assert any("holds NaN or Inf" in line for line in lines)

    roots = [str(tmp_path)]
    assert checkpoint_advice.newest_finite_checkpoint(roots, before=9) == (str(tmp_path), 2)
    assert checkpoint_advice.newest_finite_checkpoint(roots, before=2) == (str(tmp_path), 1)
    assert checkpoint_advice.newest_finite_checkpoint(roots, before=1) is None
    assert f"--load {tmp_path} --ckpt-step 1" in checkpoint_advice.resume_advice(roots, 2)


# ------------------------------------------------------------------------------------------------
# 3. a full disk: one line naming the directory and the OS error, the partial directory removed


def test_disk_full_is_one_line_and_leaves_the_previous_checkpoint(one_mib_disk):
    model = _model(width=18_000)  # 576 KB a checkpoint (weights and one moment): the second does not fit
    root = one_mib_disk / "ck"
    _save(root, 1, model)
    with pytest.raises(CheckpointWriteError) as err:
        _save(root, 2, model)
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and str(root) in msg, msg
    assert "__0_0.distcp" in msg and "still names iteration 1" in msg and "unexpected pos" not in msg
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert _load(root, _model(width=18_000))["iteration"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_on_rank_1(rank: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        weight = torch.ones(4, 4)
        sd = {
            "w": ShardedTensor.from_rank_offsets("w", weight[2 * rank : 2 * rank + 2].clone(), (0, rank, 2))
        }
        ckpt.save_checkpoint(root, 1, sd, extra_state={}, **QUIET)
        if rank == 1:

            def full(self, b):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            dcp_backend._RecordingFileIO.write = full
        try:
            ckpt.save_checkpoint(root, 2, sd, extra_state={}, **QUIET)
            queue.put((rank, "saved"))
        except CheckpointWriteError as e:
            queue.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def test_disk_full_on_another_rank_stops_every_rank_with_the_same_line(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    root = str(tmp_path / "ck")
    mp.start_processes(
        _full_on_rank_1, args=(_free_port(), root, queue), nprocs=2, join=True, start_method="spawn"
    )
    got = dict(queue.get(timeout=5) for _ in range(2))
    assert got[0] == got[1] and "No space left on device" in got[0] and "(rank 1)" in got[0], got
    assert "__1_0.distcp" in got[0] and "still names iteration 1" in got[0]
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


# ------------------------------------------------------------------------------------------------
# 4. damaged files of the checkpoint to load: one line naming the file and another checkpoint to load


def _truncate(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    "damage, file, says",
    [
        (_truncate, "__0_0.distcp", "is truncated"),
        (os.remove, "__0_0.distcp", "is missing"),
        (os.remove, ".metadata", "is missing"),
        (_truncate, ".metadata", "cannot be read"),
    ],
)
def test_damaged_file_is_named_with_the_checkpoint_to_load_instead(tmp_path, damage, file, says):
    model = _model()
    _save(tmp_path, 3, model)
    _save(tmp_path, 6, model)
    damage(tmp_path / "iter_0000006" / file)
    with pytest.raises(CheckpointReadError) as err:
        _load(tmp_path, _model())
    msg = str(err.value)
    assert "\n" not in msg and f"{tmp_path / 'iter_0000006' / file} {says}" in msg, msg
    assert "--ckpt-step 3" in msg
    assert _load(tmp_path, _model(), ckpt_step=3)["iteration"] == 3


# ------------------------------------------------------------------------------------------------
# 5. another precision, a tracker that is not text, --load naming one checkpoint


def test_optimizer_state_of_another_precision_names_the_flag(tmp_path):
    _save(tmp_path, 2, _model())  # fp32: no fp32 main-parameter copies in the optimizer state
    bf16 = _model(dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        ckpt.load_checkpoint(str(tmp_path), _sd(bf16), Optimizer(bf16, main_params=True), **QUIET)
    msg = str(err.value)
    assert "\n" not in msg and "fp32 (neither --bf16 nor --fp16)" in msg and "bf16 (--bf16)" in msg, msg
    assert "resume without --bf16 to load it, or pass --no-load-optim" in msg
    assert ckpt.load_checkpoint(str(tmp_path), _sd(bf16), **QUIET)["iteration"] == 2  # as --no-load-optim


def test_tracker_that_is_not_text_is_named(tmp_path):
    _save(tmp_path, 2, _model())
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe2")
    with pytest.raises(ValueError) as err:
        _load(tmp_path, _model())
    msg = str(err.value)
    assert str(tmp_path / "latest_checkpointed_iteration.txt") in msg and "is not text" in msg, msg


def test_load_of_one_iteration_directory_loads_it(tmp_path):
    model = _model()
    _save(tmp_path, 3, model)
    _save(tmp_path, 6, model)
    lines: list[str] = []
    assert _load(tmp_path / "iter_0000003", _model(), log=lines.append)["iteration"] == 3
    assert lines[0] == (
        f"--load {tmp_path / 'iter_0000003'} is the checkpoint of iteration 3: loading it as "
        f"--load {tmp_path} --ckpt-step 3"
    )
    with pytest.raises(ConfigError, match="--ckpt-step 6 asks for another"):
        _load(tmp_path / "iter_0000003", _model(), ckpt_step=6)


# ------------------------------------------------------------------------------------------------
# 6. --save that cannot be written


def test_save_dir_checks(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        checkpoint_dirs.check_save_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="cannot be created: .*file is a file"):
        checkpoint_dirs.check_save_dir(str(tmp_path / "file" / "ck"))
    _save(tmp_path / "run", 3, _model())
    with pytest.raises(
        ValueError,
        match=f"one checkpoint .*pass the directory that holds the checkpoints, {tmp_path / 'run'}$",
    ):
        checkpoint_dirs.check_save_dir(str(tmp_path / "run" / "iter_0000003"))
    checkpoint_dirs.check_save_dir(str(tmp_path / "new" / "deeper"))  # can be created
    assert not (tmp_path / "new").exists()  # and was not: the check has no side effect


def test_save_dir_under_a_read_only_directory(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mounted:
        if not mounted:  # a directory without write permission is read-only to this process, unless root
            if os.geteuid() == 0:
                pytest.skip("root without the right to mount: no read-only directory to test with")
            os.chmod(tmp_path / "ro", 0o555)
        with pytest.raises(
            ValueError,
            match=r"ro/ck cannot be created: .*ro is not writable \((a read-only file "
            r"system|no write permission)\)",
        ):
            checkpoint_dirs.check_save_dir(str(tmp_path / "ro" / "ck"))
