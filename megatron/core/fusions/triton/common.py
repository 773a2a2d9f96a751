"""What the Triton kernels share: the optional import, op registration, the kernel names and the
choice of which kernels a run dispatches to (:class:`TritonKernels`, resolved once at start-up)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.library import triton_op

try:  # Triton ships with CUDA builds of torch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

# The kernels a run may use, by the name the self-check, the execution plan and the report use:
#   swiglu         SwiGLU's backward (the gradient of ``silu(gate) * up`` w.r.t. ``[gate; up]``)
#   cross_entropy  the fused cross entropy's per-row loss and gradient pass over ``[c, V]`` logits
#   fp8_cast       the FP8 amax and cast-transpose (fp8 copy and its transpose from one read)
#   swiglu_fp8     the FP8 SwiGLU MLP's activation (and its gradient) quantised in the same pass
KERNELS = ("swiglu", "cross_entropy", "fp8_cast", "swiglu_fp8")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class TritonKernels:
    """The Triton kernels a run dispatches to (names from :data:`KERNELS`): those whose self-check
    passed on the run's device, as the execution plan resolved them. Empty (the default): the torch
    code everywhere. ``interpret``: Triton's interpreter runs the kernels on CPU tensors (tests)."""

    enabled: frozenset[str] = frozenset()
    interpret: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.enabled) - set(KERNELS))
        assert not unknown, f"unknown Triton kernels {unknown}; the kernels are {KERNELS}"

    def uses(self, name: str) -> bool:
        """Whether the run dispatches ``name`` to its Triton kernel."""
        assert name in KERNELS, name
        return name in self.enabled


# No Triton kernel: the torch code everywhere (the default of every entry point that takes kernels).
NO_KERNELS = TritonKernels()


def op(name: str) -> Callable[[F], F]:
    """``torch.library.triton_op(name)``: torch.compile traces into the op and Inductor launches its
    kernels from the generated code. Without Triton the function stays a plain (never called)
    function: registering it would make torch scan it for kernels and log "Triton not available"."""

    def register(fn: F) -> F:
        if triton is None:
            return fn
        return triton_op(name, mutates_args=())(fn)  # type: ignore[return-value]

    return register


def compare(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> str:
    """'' when ``|got - ref| <= tol * (1 + |ref|)`` everywhere (bf16 rounding), else the worst excess."""
    excess = ((got.float() - ref.float()).abs() - tol * (1.0 + ref.float().abs())).max().item()
    return "" if excess <= 0.0 else f"difference exceeds the bf16 tolerance by {excess:.3g}"


def rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[-1, width]`` rows with a contiguous last dim (rows may be strided)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()
