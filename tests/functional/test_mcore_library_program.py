"""A second Megatron-Core user program (examples/mcore_library_program.py) on 1, 2 and 4 processes.

The program uses only Megatron-Core's public names: a SwiGLU GPT from ``TransformerConfig(
gated_linear_unit=True, activation_func=F.silu)``, ``model_parallel_cuda_manual_seed``,
``vocab_parallel_cross_entropy`` with no group at tp 2, DDP + ``finalize_model_grads``,
``get_megatron_optimizer`` and ``dist_checkpointing`` save/load. Layout invariance: tp 2 and
tp 2 x dp 2 print the one-process losses and gradient norms; the checkpoint one process saved,
loaded under tp 2 x dp 2, gives the one-process eval loss; every save/load round trip gives back the
trained model's eval loss exactly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from launch import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "mcore_library_program.py")
STEP = re.compile(r"^step (\d+) loss ([0-9.]+) grad_norm ([0-9.]+)$", re.MULTILINE)
EVAL = re.compile(r"^(loaded eval|eval|reloaded eval) loss ([0-9.]+)$", re.MULTILINE)


def _run(cwd, nproc: int, *args: str) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """Run the program; its per-step (loss, grad norm) and its eval losses by name."""
    cwd.mkdir()
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    )
    res = subprocess.run(
        [*launcher, EXAMPLE, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    steps = [(float(loss), float(norm)) for _, loss, norm in STEP.findall(res.stdout)]
    evals = {name: float(v) for name, v in EVAL.findall(res.stdout)}
    return steps, evals


@pytest.mark.slow
def test_library_program_layouts_match_one_process(tmp_path):
    ref_steps, ref_eval = _run(tmp_path / "one", 1)
    assert len(ref_steps) == 4 and ref_steps[-1][0] < ref_steps[0][0]  # it trains
    assert ref_eval["reloaded eval"] == ref_eval["eval"]

    for nproc, extra in ((2, ()), (4, ("--eval-checkpoint", str(tmp_path / "one" / "ckpt")))):
        steps, evals = _run(tmp_path / f"n{nproc}", nproc, *extra)
        assert len(steps) == len(ref_steps), nproc
        for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
            assert loss == pytest.approx(ref_loss, abs=2e-5), nproc
            assert norm == pytest.approx(ref_norm, rel=1e-4), nproc
        assert evals["eval"] == pytest.approx(ref_eval["eval"], abs=2e-5), nproc
        assert evals["reloaded eval"] == evals["eval"], nproc
    assert evals["loaded eval"] == pytest.approx(ref_eval["eval"], abs=2e-5)  # 1 process -> tp 2 x dp 2
