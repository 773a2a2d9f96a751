"""--exit-signal-handler under every way a stop signal arrives, with DataLoader workers running.

What torchrun (torch.distributed.elastic) does, which these tests rely on and docs/checkpoints.md
tells users: it starts each rank in a session of its own; on SIGTERM or SIGINT it sends the same
signal to each rank's whole process group (the rank and its DataLoader workers), waits up to its
shutdown timeout (30 s by default; ``--shutdown-timeout`` / TORCH_ELASTIC_SHUTDOWN_TIMEOUT in recent
releases) for them, SIGKILLs what is left, and then exits 1 itself with a ``SignalException``
traceback, however cleanly the ranks stopped. A second signal to torchrun while it waits makes it
send SIGTERM to the ranks (its ``finally`` shuts them down again). So the ranks exit 0 with a
complete checkpoint while torchrun exits 1; signalled directly (SLURM signals every process of the
step, ``kill -TERM -- -PGID``), the ranks exit 0 and so does torchrun.

Run as a script, this file is torchrun's entry point for the tests here and in test_errors.py: it
runs pretrain_gpt.py as a child in its own process group and records the child's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def _rank_main() -> int:
    """pretrain_gpt.py as a child in this process group, so that it gets every signal the group
    gets; its exit code goes to $RANK_OUT/rank<R>.rc and, with $RANK_LOG, its output to
    $RANK_OUT/rank<R>.log. $RANK<R>_ARGS adds flags on rank R only."""
    rank, out = os.environ["RANK"], os.environ["RANK_OUT"]
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: None)  # a Python handler: the exec'd child starts with the default
    log = open(os.path.join(out, f"rank{rank}.log"), "w") if os.environ.get("RANK_LOG") else None
    extra = os.environ.get(f"RANK{rank}_ARGS", "").split()
    rc = subprocess.call(
        [sys.executable, PRETRAIN, *sys.argv[1:], *extra],
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
    )
    with open(os.path.join(out, f"rank{rank}.rc"), "w") as f:
        f.write(str(rc))
    return rc


if __name__ == "__main__":
    sys.exit(_rank_main())

import pytest  # noqa: E402  (the entry point above needs none of the test imports)

from megatron.training import checkpointing  # noqa: E402

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --log-interval 1 --eval-iters 2"
).split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid``, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except OSError:
                continue
    return kids


def alive(pids: list[int]) -> list[int]:
    """The processes among ``pids`` that still run (a zombie waiting to be reaped does not)."""
    running = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    running.append(p)
        except OSError:
            continue
    return running


def torchrun_ranks(
    nproc: int, args: list[str], out_dir: str, log: bool = False, per_rank: dict[int, str] | None = None
) -> subprocess.Popen:
    """torchrun (in a session of its own, as a terminal's foreground job) over this file's
    ``_rank_main``; the ranks' exit codes land in ``out_dir``."""
    env = {**ENV, "RANK_OUT": out_dir, **({"RANK_LOG": "1"} if log else {})}
    env.update({f"RANK{r}_ARGS": a for r, a in (per_rank or {}).items()})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        os.path.abspath(__file__),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )


def rank_codes(out_dir: str, nproc: int) -> list[int | None]:
    codes = []
    for r in range(nproc):
        path = os.path.join(out_dir, f"rank{r}.rc")
        codes.append(int(open(path).read()) if os.path.exists(path) else None)
    return codes


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 300.0) -> list[str]:
    """Lines of ``proc``'s output up to the one holding ``needle``; a process that hangs or ends
    first fails the test (killed after ``timeout`` seconds) instead of blocking it."""
    seen: list[str] = []
    assert proc.stdout is not None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if needle in line:
                return seen
    finally:
        timer.cancel()
    raise AssertionError(f"no {needle!r} in the output:\n" + "".join(seen)[-3000:])


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


# ---------------------------------------------------------------------------------------------
# The handler and the workers, in one process.


@pytest.fixture
def handler():
    from megatron.training.loop_utils import DistributedSignalHandler

    h = DistributedSignalHandler()
    yield h
    h.release()


def test_first_signal_is_recorded_repeated_sigterm_ignored(handler):
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.received == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # SLURM's and torchrun's copy of the same stop
    assert handler.received == signal.SIGTERM


@pytest.mark.parametrize(
    "first, second",
    [(signal.SIGINT, signal.SIGINT), (signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
)
def test_a_signal_after_ctrl_c_aborts(handler, first, second):
    """A second Ctrl-C aborts; under torchrun it reaches the ranks as SIGTERM."""
    os.kill(os.getpid(), first)
    assert handler.received == first
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), second)
        time.sleep(1)  # the handler runs in the main thread between bytecodes
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # released


WORKERS_SCRIPT = """
import os, signal, sys, time
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
got = []
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: got.append(n))
loader = build_pretraining_data_loader(list(range(64)), 0, 2, 0, 1, num_workers=2)
it = iter(loader)
next(it)
print("ready", flush=True)
while len(got) < 2:
    time.sleep(0.01)
next(it), next(it), next(it)  # the workers are alive and serving
print("served", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_ignore_stop_signals_and_die_with_their_rank():
    """Group-wide SIGTERM and SIGINT leave the workers serving; SIGKILL of the rank alone takes
    them down at once (PR_SET_PDEATHSIG), not after the DataLoader watchdog's 5 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKERS_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=ENV,
        start_new_session=True,
    )
    try:
        _read_until(proc, "ready")
        workers = children(proc.pid)
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _read_until(proc, "served")
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert _wait_gone(workers, 2.0) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


CRASH_SCRIPT = """
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
loader = build_pretraining_data_loader(list(range(64)), 0, 2, 0, 1, num_workers=2)
it = iter(loader)
next(it)
raise RuntimeError("a bug, with the workers running")
"""


def test_a_crash_with_workers_running_exits_at_once():
    """The workers ignore SIGTERM, which multiprocessing's exit hook sends them before joining: the
    rank's own hook kills them first, so the process ends with its traceback instead of hanging."""
    res = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60
    )
    assert res.returncode == 1 and res.stderr.rstrip().endswith(
        "RuntimeError: a bug, with the workers running"
    )
    assert "DataLoader worker" not in res.stderr


AMID_SCRIPT = """
import os, signal, time
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
loader = build_pretraining_data_loader(list(range(64)), 0, 2, 0, 1, num_workers=2)
it = iter(loader)  # the workers start with the stop signals' default action, as in the trainer
got = []
signal.signal(signal.SIGTERM, lambda n, f: got.append(n))  # the rank's handler comes after the loaders
os.killpg(0, signal.SIGTERM)  # at once: the workers may not have reached their init yet
while not got:
    time.sleep(0.01)
print(len([next(it) for _ in range(8)]), "served", flush=True)
"""


def test_workers_started_amid_a_group_signal_survive_it():
    """A SIGTERM to the process group while the workers are still starting (before their init makes
    them ignore it) is held back in them, so they survive it; the rank gets it as usual."""
    for _ in range(3):  # a race: a few tries make a regression show
        proc = subprocess.Popen(
            [sys.executable, "-c", AMID_SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=ENV,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0 and "8 served" in out, out[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# End to end: finish the step, save a complete checkpoint, every rank exits 0.


def _check_saved(ck, out: str, name: str, tracebacks: int = 0, at_least: int = 3) -> None:
    assert f"exiting on {name}" in out, out[-3000:]
    assert out.count("Traceback") == tracebacks and "DataLoader worker" not in out, out[-3000:]
    it = checkpointing.read_tracker(str(ck))
    assert it is not None and it >= at_least, out[-3000:]
    assert out.count("successfully saved checkpoint") == 1  # one collective save


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the process", "Ctrl-C (SIGINT to the process group)"])
def test_single_process_saves_and_exits_0(tmp_path, how):
    ck = tmp_path / "ck"
    cmd = [
        sys.executable,
        PRETRAIN,
        *TINY,
        "--num-workers",
        "2",
        "--train-iters",
        "100000",
        "--save",
        str(ck),
        "--exit-signal-handler",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=ENV,
        start_new_session=True,
    )
    try:
        seen = _read_until(proc, "iteration        3/")
        workers = children(proc.pid)
        assert len(workers) >= 2, workers  # mock data is loaded by worker processes
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + out
    assert proc.returncode == 0, out[-3000:]
    _check_saved(ck, out, "SIGTERM" if how.startswith("SIGTERM") else "SIGINT")
    assert _wait_gone(workers, 10.0) == []


WAYS = {
    # way: (what is signalled, the signal the ranks see, torchrun's exit code)
    "SIGTERM to torchrun": ("torchrun", signal.SIGTERM, 1),
    "SIGTERM to each rank's process group": ("every rank group", signal.SIGTERM, 0),
    "Ctrl-C (SIGINT to torchrun's process group)": ("torchrun group", signal.SIGINT, 1),
    "SIGTERM to one rank's process group": ("one rank group", signal.SIGTERM, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_torchrun_two_ranks_save_and_exit_0(tmp_path, way):
    """Two ranks with two DataLoader workers per loader. With one rank signalled, the flag is
    max-reduced with the step results, so both finish the same step and save one checkpoint."""
    target, sig, torchrun_rc = WAYS[way]
    ck = tmp_path / "ck"
    proc = torchrun_ranks(
        2,
        [*TINY, "--num-workers", "2", "--train-iters", "100000", "--save", str(ck), "--exit-signal-handler"],
        str(tmp_path),
    )
    try:
        seen = _read_until(proc, "iteration        3/")
        groups = sorted(children(proc.pid))  # the wrappers: each leads its rank's process group
        ranks = [c for g in groups for c in children(g)]
        workers = [w for r in ranks for w in children(r)]
        assert len(groups) == 2 and len(ranks) == 2 and len(workers) >= 4, (groups, ranks, workers)
        if target == "torchrun":
            proc.send_signal(sig)
        elif target == "torchrun group":
            os.killpg(proc.pid, sig)
        else:
            for g in groups if target == "every rank group" else groups[-1:]:
                os.killpg(g, sig)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + out
    assert rank_codes(str(tmp_path), 2) == [0, 0], out[-3000:]
    assert proc.returncode == torchrun_rc, out[-3000:]
    # torchrun's own traceback when it was signalled: SignalException: Process <pid> got signal: <n>
    _check_saved(ck, out, sig.name, tracebacks=1 if torchrun_rc else 0)
    assert ("SignalException" in out) == bool(torchrun_rc)
    assert _wait_gone(workers, 10.0) == []
