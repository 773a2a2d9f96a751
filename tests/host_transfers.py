"""A test helper that records what, on a GPU, would make the host wait for the device inside a step."""

from __future__ import annotations

import os
import sys

from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HostTransfers(TorchDispatchMode):
    """Records the ops that move a value between host and device: a tensor made from a Python value
    (``lift_fresh``: ``t[i] = True``, ``torch.tensor(...)``; on a GPU a copy that waits for the stream
    unless it goes through pinned memory without blocking) and a read back to Python (``item()``,
    ``float(t)``: always a wait). Sees every op of eager code and of autograd's backward on the CPU,
    where the tests run, so a sync shows up before a GPU profile would find it.

    ``seen`` holds ``(op, site)``: ``site`` is ``"megatron/...py:function"``, the innermost frame of
    our library that issued it (``"?"`` when none did).
    """

    SYNCING = {"aten.lift_fresh.default", "aten._local_scalar_dense.default"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.SYNCING:
            self.seen.append((str(func), _site()))
        return func(*args, **(kwargs or {}))


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.relpath(frame.f_code.co_filename, _ROOT)
        if path.startswith("megatron" + os.sep):
            return f"{path}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"
