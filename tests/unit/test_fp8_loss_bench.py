"""bench/fp8_loss.py --combine: the mean-over-seeds verdict from rows that several invocations wrote."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import fp8_loss  # noqa: E402  (bench/ is not a package)


def _curve(level: float, steps: int = 120) -> dict[str, float]:
    return {str(s): level * (1.0 + 1.0 / s) for s in range(1, steps + 1)}


def _rows(path, seed: int, runs: dict[str, float]) -> None:
    with open(path, "w") as f:
        for name, level in runs.items():
            f.write(
                json.dumps(
                    {"run": name, "seed": seed, "iters": 120, "model": "small", "losses": _curve(level)}
                )
                + "\n"
            )
        f.write(
            json.dumps({"run": "x", "seeds": [seed], "pass": True}) + "\n"
        )  # an earlier mean row: skipped


def test_combine_compares_mean_curves_over_the_seeds_of_several_files(tmp_path, capsys):
    # Per seed the recipe is 1.5% off bf16 (each would FAIL at 1%), in opposite directions: the mean passes.
    # The "far" recipe is 2% above on both seeds: it fails on the mean too. "cut" ran on one seed only.
    _rows(tmp_path / "a.jsonl", 1, {"bf16": 4.0, "near": 4.0 * 1.015, "far": 4.0 * 1.02, "cut": 4.0})
    _rows(tmp_path / "b.jsonl", 2, {"bf16": 5.0, "near": 5.0 * (1 - 0.015), "far": 5.0 * 1.02})
    fp8_loss.combine([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], 0.01, str(tmp_path))
    rows = {r["run"]: r for r in map(json.loads, open(tmp_path / "fp8_loss.jsonl"))}
    assert set(rows) == {"near", "far"}  # "cut" is left out, and said so
    assert "cut: 1 of 2 seeds ran" in capsys.readouterr().out
    assert rows["near"]["seeds"] == [1, 2] and rows["near"]["pass"]
    assert abs(rows["near"]["rel_diff_last_mean"]) < 0.005
    assert not rows["far"]["pass"] and rows["far"]["rel_diff_last_mean"] == pytest.approx(0.02, rel=1e-6)


def test_combine_without_bf16_rows_says_so(tmp_path):
    _rows(tmp_path / "a.jsonl", 1, {"hybrid:delayed": 4.0})
    with pytest.raises(SystemExit, match="no bf16 rows"):
        fp8_loss.combine([str(tmp_path / "a.jsonl")], 0.01, str(tmp_path))
