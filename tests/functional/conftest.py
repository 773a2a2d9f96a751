"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launch import ROOT


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """(data flags examples/prepare_corpus.sh prints, the prefix) for the bundled corpus, prepared once
    per session by the example itself."""
    out = tmp_path_factory.mktemp("prepared")
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "prepare_corpus.sh"), str(out), "4096", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    printed = res.stdout.split("Data flags for pretrain_gpt.py:")[1].splitlines()
    flags = " ".join(ln.rstrip(" \\") for ln in printed if ln.startswith("  --")).split()
    return flags, flags[flags.index("--data-path") + 1]
