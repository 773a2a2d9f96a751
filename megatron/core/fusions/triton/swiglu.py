"""SwiGLU's backward as one Triton kernel: the gradient of ``silu(gate) * up`` with respect to fc1's
output ``[gate; up]`` reads ``grad``, ``gate`` and ``up`` once and writes both halves (the torch code
loads each input of the concatenated output separately; docs/performance.md, "The Triton kernels
on their own")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.triton.common import compare, op, tl, triton
from megatron.core.fusions.triton.common import rows as _rows

if triton is not None:

    @triton.jit
    def swiglu_grads(g, a, b):  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        """``(d gate, d up)`` of ``silu(a) * b`` for the incoming gradient ``g`` (fp32)."""
        s = tl.sigmoid(a)
        return g * b * s * (1.0 + a * (1.0 - s)), g * a * s

    @triton.jit
    def swiglu_bwd_kernel(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        grad_ptr,
        x_ptr,
        dx_ptr,
        f,
        grad_stride,
        x_stride,
        dx_stride,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        g = tl.load(grad_ptr + row * grad_stride + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_stride + f + cols, mask=mask, other=0.0).to(tl.float32)
        d_gate, d_up = swiglu_grads(g, a, b)
        out = dx_ptr + row * dx_stride
        tl.store(out + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(out + f + cols, d_up.to(dx_ptr.dtype.element_ty), mask=mask)


def swiglu_fp32(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``x = [gate; up]``, computed in fp32 and rounded once (as Inductor's
    fused kernel and the FP8 SwiGLU kernels do)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def swiglu_backward_torch(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The torch code of the kernel: d(silu(gate) * up) / d[gate; up] in fp32, rounded once."""
    a, b = x.float().chunk(2, dim=-1)
    g = grad.float()
    s = torch.sigmoid(a)
    return torch.cat((g * b * s * (1.0 + a * (1.0 - s)), g * a * s), dim=-1).to(x.dtype)


def swiglu_backward_triton(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on ``grad [..., F]`` and ``x [..., 2F]`` (CUDA, or CPU under the interpreter)."""
    f = grad.shape[-1]
    g2, x2 = _rows(grad, f), _rows(x, 2 * f)
    dx = torch.empty((x2.shape[0], 2 * f), dtype=x.dtype, device=x.device)
    block = 1024
    grid = (x2.shape[0], triton.cdiv(f, block))
    torch.library.wrap_triton(swiglu_bwd_kernel)[grid](
        g2, x2, dx, f, g2.stride(0), x2.stride(0), dx.stride(0), BLOCK=block, num_warps=4
    )
    return dx.view(x.shape)


@op("megatron::swiglu_backward")
def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_backward_triton` as a ``triton_op`` (compiled code launches the kernel itself)."""
    return swiglu_backward_triton(grad, x)


def check_swiglu(device: torch.device) -> str:
    """'' when the kernel matches the torch code on a small problem on ``device``, else what differs."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(64, 2 * 1000, device=device, generator=g) * 3).bfloat16()
    grad = torch.randn(64, 1000, device=device, generator=g).bfloat16()
    return compare(swiglu_backward_triton(grad, x), swiglu_backward_torch(grad, x))
