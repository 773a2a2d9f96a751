"""scripts/slurm/pretrain_gpt.sbatch under a real Slurm: it trains, is preempted the two ways Slurm
and its users signal a job (the time-limit warning to the batch shell, a SIGTERM to the ranks),
requeues itself, resumes from the checkpoint it wrote each
time, and ends on the losses of an uninterrupted run.

The fixture starts munged, slurmctld and one slurmd on localhost (Debian's packages; .ci/run installs
them) with a generated slurm.conf that needs no cgroups and no accounting database, everything under a
temporary directory. Without Slurm the test is skipped, unless MEGATRON_REQUIRE_SLURM is set (CI sets
it), when it fails.

Slurm makes a requeued job wait 120 s before it may start again (its BeginTime); the test moves that
to a few seconds later with `scontrol update StartTime=now`, as an administrator can.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from launch import ROOT, metrics

from megatron.training.checkpoint_dirs import read_tracker

pytestmark = pytest.mark.slow

SBATCH = os.path.join(ROOT, "scripts", "slurm", "pretrain_gpt.sbatch")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue")
TRAIN_ITERS = 40
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    f"--lr-warmup-iters 2 --mock-data --vocab-size 128 --log-interval 1 --eval-iters 0 --num-workers 2 "
    f"--train-iters {TRAIN_ITERS} --save-interval 1000 --exit-signal-handler"
).split()
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.* lm loss: (\S+) \|.* grad norm: (\S+) \|")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=megatron-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/socket
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in a container: track processes through /proc, bind nothing, account nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=600
FirstJobId={first_job}
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """The daemons of a one-node cluster and the environment its clients need."""

    def __init__(self, root: str):
        self.dir = root
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": os.path.join(root, "slurm.conf"), "OMP_NUM_THREADS": "1"}
        self.env["PATH"] = (
            os.path.dirname(sys.executable) + ":" + self.env.get("PATH", "") + ":/usr/sbin:/sbin"
        )
        self.env.pop("REPO", None)  # the batch script finds the checkout itself
        self.jobs: list[str] = []

    def start(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(d, sub), mode=0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(
                SLURM_CONF.format(
                    d=d, ctld_port=_free_port(), d_port=_free_port(), first_job=1000 + os.getpid() % 20000
                )
            )
        m = os.path.join(d, "munge")
        self._daemon(
            "munged", "-F", "-f", f"--key-file={key}", f"--socket={m}/socket", f"--pid-file={m}/munged.pid",
            f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed",
        )  # fmt: skip
        self._until(lambda: os.path.exists(f"{m}/socket"), 20, "munged's socket")
        self._daemon("slurmctld", "-D", "-c")
        self._until(lambda: self.run("sinfo", check=False).returncode == 0, 30, "slurmctld to answer")
        self._daemon("slurmd", "-D", "-N", "localhost")
        self._until(
            lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False).stdout,
            30,
            "the node to be idle",
        )

    def _daemon(self, name: str, *args: str) -> None:
        out = open(os.path.join(self.dir, f"{name}.stdout"), "w")
        self.procs.append(
            subprocess.Popen(
                [_which(name) or name, *args], stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        )

    def _until(self, ready, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: {dead or 'timed out'}\n" + self.logs())
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(
            [_which(cmd[0]) or cmd[0], *cmd[1:]], capture_output=True, text=True, env=self.env
        )
        assert res.returncode == 0 or not check, (cmd, res.stdout, res.stderr, self.logs())
        return res

    def logs(self) -> str:
        text = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log", "slurmctld.stdout", "slurmd.stdout"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text.append(f"---- {name} (end)\n" + f.read()[-3000:])
        return "\n".join(text)

    def submit(self, launcher: str, out: str, args: list[str], **env_vars: str) -> str:
        env = {**self.env, "LAUNCHER": launcher, "PYTHON": sys.executable, **env_vars}
        res = subprocess.run(
            [_which("sbatch") or "sbatch", "--parsable", "--gpus-per-node=0", "--ntasks-per-node=2",
             f"--output={out}", f"--chdir={self.dir}", SBATCH, *args],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert res.returncode == 0, (res.stdout, res.stderr, self.logs())
        self.jobs.append(res.stdout.strip().split(";")[0])
        return self.jobs[-1]

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, Reason, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def stop(self) -> None:
        if self.jobs:
            self.run("scancel", *self.jobs, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    why = f"Slurm is not installed ({', '.join(missing)} missing)" if missing else None
    if not why and os.geteuid() != 0:
        why = "slurmd must run as root"
    if why:
        if os.environ.get("MEGATRON_REQUIRE_SLURM"):
            pytest.fail(f"{why}, and MEGATRON_REQUIRE_SLURM is set (.ci/run installs Debian's packages)")
        pytest.skip(why)
    root = str(tmp_path_factory.mktemp("slurm"))
    if len(root) > 60:  # Unix socket paths under it (108 bytes at most) must stay short
        root = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
    cluster = Slurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if not root.startswith(str(tmp_path_factory.getbasetemp())):
            shutil.rmtree(root, ignore_errors=True)


def _wait(slurm: Slurm, job: str, out: str, ready, seconds: float, what: str):
    """Poll ``ready()`` until it returns something true; the job's output and the daemons' logs on
    failure."""
    deadline = time.monotonic() + seconds
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}: {slurm.job(job)}\n{_read(out)[-4000:]}\n{slurm.logs()}"
            )
        time.sleep(0.1)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _losses(text: str) -> dict[int, list[tuple[str, str]]]:
    """Iteration -> every (lm loss, grad norm) its log lines printed."""
    out: dict[int, list[tuple[str, str]]] = {}
    for m in LOSS.finditer(text):
        out.setdefault(int(m[1]), []).append((m[2], m[3]))
    return out


def _finished(slurm: Slurm, job: str):
    info = slurm.job(job)
    return info if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None


def _start_over(out: str, restart: int):
    def over() -> bool:
        if _read(out).count("pretrain_gpt.sbatch: step exit code") < restart + 1:
            return False
        return subprocess.run(["pgrep", "-x", "srun"], capture_output=True).returncode != 0

    return over


def _started(out: str, job: str, restart: int):
    marker = f"job {job} start {restart}: LAUNCHER=srun, 2 ranks (1 x 2)"
    return lambda: marker in _read(out)


def _trained(ck: str, iteration: int):
    path = os.path.join(ck, "metrics.jsonl")
    return lambda: os.path.exists(path) and max(metrics(path, "lm loss"), default=0) >= iteration


def _requeued(slurm: Slurm, job: str, restarts: int):
    def ready():
        info = slurm.job(job)
        return info["Restarts"] == str(restarts) and info["JobState"] == "PENDING"

    return ready


def test_preempted_twice_requeues_resumes_and_matches_the_uninterrupted_run(slurm, tmp_path):
    # The reference: the torchrun form, uninterrupted.
    ref_ck, ref_out = str(tmp_path / "ref"), str(tmp_path / "ref.out")
    ref = slurm.submit("torchrun", ref_out, [*TINY, "--save", ref_ck, "--load", ref_ck], DRY_RUN="0")
    info = _wait(slurm, ref, ref_out, lambda: _finished(slurm, ref), 150, "the reference job to end")
    ref_text = _read(ref_out)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), ref_text[
        -4000:
    ]
    assert (
        "LAUNCHER=torchrun, 2 ranks (1 x 2), rendezvous localhost:" in ref_text
        and f"repo {ROOT}\n" in ref_text
    )
    expected = _losses(ref_text)
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1)), ref_text[-4000:]
    ref_metrics = metrics(os.path.join(ref_ck, "metrics.jsonl"), "lm loss")

    # The srun form, stopped twice before it finishes. (Slurm's own `scontrol requeue`, which signals
    # every process, is left out: the start after it was cancelled by the old allocation's teardown
    # in about half the runs on a loaded machine.)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "job.out")
    job = slurm.submit("srun", out, [*TINY, "--save", ck, "--load", ck])
    ways = [
        # how a stop reaches the job: Slurm's warning before the time limit (--signal=B:USR1@300) to the
        # batch shell; a SIGTERM to every task of the step
        ("scancel", "--batch", "--signal=USR1", job),
        ("scancel", "--signal=TERM", job),
    ]
    saved = [0]  # the checkpoint each start resumes from
    for restart, way in enumerate(ways):
        _wait(slurm, job, out, _started(out, job, restart), 120, f"start {restart}")
        _wait(slurm, job, out, _trained(ck, saved[-1] + 2), 120, f"start {restart} to train 2 steps")
        slurm.run(*way)
        _wait(slurm, job, out, _requeued(slurm, job, restart + 1), 120, f"the requeue after {' '.join(way)}")
        saved.append(read_tracker(ck) or 0)
        assert saved[-2] < saved[-1] < TRAIN_ITERS, (way, saved, _read(out)[-4000:])
        # Only once the last start is over: its batch script's closing line, and no srun of it left
        _wait(slurm, job, out, _start_over(out, restart), 120, f"start {restart} to end")
        # Slurm holds a requeued job 120 s; start it now, but in a later second than its last run's
        # credential was revoked in (slurmd refuses a launch with a credential as old)
        time.sleep(1.5)
        slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = _wait(slurm, job, out, lambda: _finished(slurm, job), 150, "the job to end")
    text = _read(out)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), text[-4000:]

    # Each start but the last: the ranks got SIGTERM, saved one checkpoint, exited 0; the script
    # requeued the job itself only when Slurm was not already doing so.
    starts = text.split("pretrain_gpt.sbatch: job ")[1:]
    assert len(starts) == 3, text[-4000:]
    for restart, (start, stop) in enumerate(zip(starts, saved)):
        if restart:
            assert f"resuming from {ck}/iter_{stop:07d}: iteration {stop}," in start, start[-3000:]
        if restart < 2:
            assert "received SIGTERM: finishing the step, saving and exiting" in start, start[-3000:]
            assert f"successfully saved checkpoint from iteration {saved[restart + 1]:7d}" in start
            assert "exiting on SIGTERM" in start and "step exit code 0, stopped by SIG" in start, start[
                -3000:
            ]
            assert "requeueing job" in start, start[-3000:]
        assert "Traceback" not in start and "DataLoader worker" not in start, start[-3000:]
    assert "got SIGUSR1: the ranks save and stop" in starts[0]
    dry = "dry run: configuration is valid for 2 process(es)"
    assert [dry in start for start in starts] == [True, False, False]  # the first start only
    assert "step exit code 0, job RUNNING" in starts[2]

    # The same losses and gradient norms as the uninterrupted run, at every iteration.
    got = _losses(text)
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), text[-4000:]
    for it, values in got.items():
        assert values == expected[it] * len(values), (it, values, expected[it])
    got_metrics = metrics(os.path.join(ck, "metrics.jsonl"), "lm loss")
    assert {i: r["lm loss"] for i, r in got_metrics.items()} == {
        i: r["lm loss"] for i, r in ref_metrics.items()
    }
