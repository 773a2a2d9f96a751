"""Small file systems for the checkpoint fault tests: a tmpfs where the test may mount one (root), and
a 1 MiB disk (that tmpfs, or ENOSPC simulated in the checkpoint writer where mounting is refused)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[bool]:
    """Mount a tmpfs at ``path`` (root only); yields whether it is mounted."""
    path.mkdir()
    try:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
            ).returncode
            == 0
        )
    except OSError:
        mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def one_mib_disk(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A directory on a 1 MiB file system: a tmpfs where this process may mount one (root), otherwise
    ENOSPC simulated in the checkpoint writer once 1 MiB has been written through it."""
    from megatron.core.dist_checkpointing import torch_dist

    with tmpfs(tmp_path / "disk", "size=1m") as mounted:
        if not mounted:
            left = [1 << 20]
            original = torch_dist._RecordingFileIO.write

            def write(self, b):
                size = memoryview(b).nbytes
                if size > left[0]:
                    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    self.first_error = self.first_error or error
                    raise error
                left[0] -= size
                return original(self, b)

            monkeypatch.setattr(torch_dist._RecordingFileIO, "write", write)
        yield tmp_path / "disk"
