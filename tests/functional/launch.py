"""Shared by the end-to-end tests: start scripts under torchrun and read the metrics files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(
    nproc: int, args: list[str], script: str = "pretrain_gpt.py", expect_ok: bool = True, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run ``script`` (relative to the repository) on ``nproc`` local gloo processes."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        os.path.join(ROOT, script),
        *args,
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
