"""Megatron-Core's walkthrough, examples/run_simple_mcore_train_loop.py, under torchrun on two ranks.

It makes Megatron-Core's example's calls (TransformerConfig without the tp size under tp 2, the model
in DistributedDataParallel, the dataset's attention mask read from the batch and passed to the model,
finalize_model_grads, save and load to ./ckpt). tests/unit/test_attention_mask.py checks that the
causal mask takes the fused causal path and that any other mask is applied.
"""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys

import pytest
from launch import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "run_simple_mcore_train_loop.py")
LOSS = re.compile(r"^Iteration (\d): Losses reduced: \[\{'lm loss': tensor\(([0-9.]+)", re.MULTILINE)


def _run(cwd: str, *script: str) -> list[str]:
    """Each rank's stdout, rank 0 first (torchrun writes one log per rank, so lines never interleave)."""
    os.makedirs(cwd)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        os.path.join(cwd, "logs"),
        "--redirects",
        "3",
        *script,
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, cwd=cwd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    logs = sorted(
        glob.glob(os.path.join(cwd, "logs", "**", "stdout.log"), recursive=True),
        key=lambda p: int(os.path.basename(os.path.dirname(p))),
    )
    outs = [open(p).read() for p in logs]
    errs = [open(p.replace("stdout.log", "stderr.log")).read()[-3000:] for p in logs]
    assert res.returncode == 0 and len(outs) == 2, (res.stderr[-3000:], errs)
    return outs


@pytest.mark.slow
def test_megatron_core_walkthrough(tmp_path):
    outs = _run(str(tmp_path / "run"), EXAMPLE)
    losses = [LOSS.findall(out) for out in outs]
    assert [it for it, _ in losses[0]] == ["0", "1", "2", "3", "4"], outs[0][-2000:]
    assert losses[0] == losses[1]  # the tp ranks report the same loss
    assert all(math.isfinite(float(v)) and float(v) > 0 for _, v in losses[0])
    assert all("Successfully loaded the model" in out for out in outs)
    assert os.listdir(tmp_path / "run" / "ckpt")  # the checkpoint went to ./ckpt
