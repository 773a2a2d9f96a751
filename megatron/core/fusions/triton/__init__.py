"""Hand-written Triton kernels for memory-bound steps, each next to the torch code it replaces.

* ``swiglu`` (:mod:`.swiglu`): SwiGLU's backward in one pass over its three inputs;
* ``cross_entropy`` (:mod:`.cross_entropy`): the fused cross entropy's per-row loss and gradient;
* ``fp8_cast`` (:mod:`.fp8_cast`): the FP8 linears' quantisation, an fp8 tensor and its transpose
  from one read, with the amax for delayed scaling;
* ``swiglu_fp8`` (:mod:`.swiglu_fp8`): the FP8 SwiGLU MLP's two quantisations inside SwiGLU's passes.

All compute in fp32 and round once when storing, as Inductor's kernels do. Which of them a run uses
is decided once, at start-up: :func:`self_check` runs every kernel against its torch code on the
run's device, and the execution plan turns the result into a :class:`TritonKernels` that every entry
point takes explicitly. Nothing here remembers a result or falls back by itself: a kernel that raises
after passing its check is a bug and propagates. Under ``TRITON_INTERPRET=1`` (read by the caller)
the kernels run on CPU tensors, which is how the tests check them without a GPU. Performance figures:
docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from megatron.core.fusions.triton.common import KERNELS, NO_KERNELS, TritonKernels, triton
from megatron.core.fusions.triton.cross_entropy import check_cross_entropy
from megatron.core.fusions.triton.fp8_cast import check_fp8_cast
from megatron.core.fusions.triton.swiglu import check_swiglu
from megatron.core.fusions.triton.swiglu_fp8 import check_swiglu_fp8

# Each kernel's check: '' when it matches its torch code on a small problem on the device.
SELF_CHECKS: Mapping[str, Callable[[torch.device], str]] = MappingProxyType(
    {
        "swiglu": check_swiglu,
        "cross_entropy": check_cross_entropy,
        "fp8_cast": check_fp8_cast,
        "swiglu_fp8": check_swiglu_fp8,
    }
)
assert tuple(SELF_CHECKS) == KERNELS


def self_check(device: torch.device, interpret: bool = False) -> dict[str, str | None]:
    """Run every kernel's self-check on ``device`` now: ``name -> None`` (passed) or why it cannot
    run here (Triton not importable, not a CUDA device, the check's mismatch or exception).

    ``interpret``: ``TRITON_INTERPRET=1`` is set (read once at start-up), so CPU devices run the
    kernels through Triton's interpreter. Nothing is cached: each call checks again.
    """
    device = torch.device(device)
    if triton is None:
        return dict.fromkeys(KERNELS, "Triton is not importable")
    if device.type != "cuda" and not interpret:
        return dict.fromkeys(KERNELS, f"not a CUDA device ({device.type})")
    results: dict[str, str | None] = {}
    for name, check in SELF_CHECKS.items():
        try:
            mismatch = check(device)
        except Exception as exc:  # noqa: BLE001 - a compiler or driver failure: the kernel cannot run here
            results[name] = f"its self-check failed: {type(exc).__name__}: {exc}"
        else:
            results[name] = f"disagrees with the torch code: {mismatch}" if mismatch else None
    return results


def passed(results: dict[str, str | None], interpret: bool = False) -> TritonKernels:
    """The :class:`TritonKernels` of the kernels whose check passed in ``results``."""
    return TritonKernels(frozenset(name for name, reason in results.items() if reason is None), interpret)


__all__ = ["KERNELS", "NO_KERNELS", "SELF_CHECKS", "TritonKernels", "passed", "self_check", "triton"]
