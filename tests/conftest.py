"""Shared pytest set-up: tests run on the CPU, single-threaded, from the repository root."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Keep the launcher's variables of an outer torchrun out of in-process runs.
for _var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_var, None)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def repo_root() -> str:
    return ROOT


@pytest.fixture
def one_mib_disk(tmp_path, monkeypatch):
    """A directory on a 1 MiB file system (tests/disk_faults.py)."""
    from tests import disk_faults

    yield from disk_faults.one_mib_disk(tmp_path, monkeypatch)
