"""SwiGLU, ``silu(gate) * up`` over the last dim ``[gate; up]`` of fc1's output, in its two
implementations (the execution plan picks one per run; the MLP receives it at construction):

* :func:`swiglu_torch`: the torch ops (autograd's own backward; Inductor fuses both when compiled);
* :func:`swiglu_triton` (:class:`SwiGLU`): the forward computed in fp32 and rounded once, the backward
  one Triton kernel that reads each input once (:mod:`megatron.core.fusions.triton.swiglu`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.fusions.triton.swiglu import swiglu_backward, swiglu_fp32


def swiglu_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where the last dim of ``x`` ``[..., 2F]`` is ``[gate; up]`` -> ``[..., F]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over ``x = [gate; up]`` (fp32, rounded once); backward the Triton kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return swiglu_fp32(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return swiglu_backward(grad, x)


def swiglu_triton(x: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_torch` with the Triton backward (:class:`SwiGLU`); CUDA tensors (or the interpreter)."""
    out: torch.Tensor = SwiGLU.apply(x)
    return out
