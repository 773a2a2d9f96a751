"""Shared by the end-to-end tests: start scripts under torchrun and read the metrics files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MULTI_RUN = os.path.join("tests", "functional", "multi_run.py")
RUN_MARKER = "multi_run.py: run "  # multi_run.MARKER (a script, not imported here)


def torchrun(
    nproc: int, args: list[str], script: str = "pretrain_gpt.py", expect_ok: bool = True, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run ``script`` (relative to the repository) on ``nproc`` local gloo processes."""
    return _torchrun(nproc, [os.path.join(ROOT, script), *args], expect_ok, timeout)


def torchrun_many(
    nproc: int, runs: list[list[str]], timeout: int | None = None
) -> list[subprocess.CompletedProcess]:
    """Run several pretrain_gpt.py configurations (flag lists) one after the other in one launch of
    ``nproc`` processes (tests/functional/multi_run.py): each run starts as a separate launch would
    (same seeds, same losses bit for bit), the interpreters' start-up is paid once. Every run must
    succeed. Returns one CompletedProcess per run (returncode 0, that run's stdout and stderr);
    ``timeout`` defaults to 600 s a run."""
    args: list[str] = [os.path.join(ROOT, MULTI_RUN)]
    for i, run in enumerate(runs):
        args += (["--next-run"] if i else []) + run
    res = _torchrun(nproc, args, True, 600 * len(runs) if timeout is None else timeout)
    outs, errs = _cut(res.stdout, len(runs)), _cut(res.stderr, len(runs))
    return [subprocess.CompletedProcess(res.args, 0, out, err) for out, err in zip(outs, errs)]


def torchrun_by_size(runs: dict[str, tuple[int, list[str]]]) -> dict[str, subprocess.CompletedProcess]:
    """``name -> (processes, flags)``: the runs of one process count share one launch
    (``torchrun_many``, in the order given), one launch per count. Returns each run's output by name."""
    sizes: dict[int, list[str]] = {}
    for name, (nproc, _) in runs.items():
        sizes.setdefault(nproc, []).append(name)
    out: dict[str, subprocess.CompletedProcess] = {}
    for nproc, names in sizes.items():
        out.update(zip(names, torchrun_many(nproc, [runs[n][1] for n in names])))
    return out


def _cut(text: str, num_runs: int) -> list[str]:
    """The output of each run, from multi_run.py's marker lines (what precedes the first is dropped)."""
    parts = [""] * num_runs
    index = -1
    for line in text.splitlines(keepends=True):
        if line.startswith(RUN_MARKER):
            index = int(line[len(RUN_MARKER) :].split()[0]) - 1
        elif index >= 0:
            parts[index] += line
    assert index == num_runs - 1, text[-2000:]
    return parts


def _torchrun(
    nproc: int, script_args: list[str], expect_ok: bool, timeout: int
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *script_args,
    ]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if expect_ok:
        assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return res


def metrics(path: str, key: str) -> dict[int, dict]:
    """Iteration -> record, for the metrics-file records that hold ``key``."""
    with open(path) as f:
        return {rec["iteration"]: rec for rec in map(json.loads, f) if key in rec}
