"""The FP8 SwiGLU MLP's two quantisations folded into the passes that compute their inputs:
SwiGLU's output straight to fp8 (fc2's input, both layouts, with its amax) and SwiGLU's gradient
straight to fp8 (fc1's output gradient), so neither bf16 tensor is written and read back.

Each function takes ``use_triton`` (the run's :class:`TritonKernels` says ``swiglu_fp8``): the
Triton op, or the torch code (SwiGLU's pass followed by the cast-transpose), whose fp8 codes equal
the kernel's but for rare neighbours (the self-check's tolerance).
"""

from __future__ import annotations

import torch

from megatron.core.fusions.triton.common import op, rows, tl, triton
from megatron.core.fusions.triton.fp8_cast import fp8_cast_transpose_torch
from megatron.core.fusions.triton.swiglu import swiglu_backward_torch, swiglu_fp32

if triton is not None:
    from megatron.core.fusions.triton.fp8_cast import store_cast_transpose, tile_amax
    from megatron.core.fusions.triton.swiglu import swiglu_grads

    @triton.jit
    def swiglu_cast_transpose_kernel(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        x_ptr,
        scale_ptr,
        out_ptr,
        out_t_ptr,
        part_ptr,
        m,
        f,
        x_stride,
        FMAX: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        """SwiGLU's forward and fc2's input quantisation in one pass: for a ``[BM, BN]`` tile of the
        output ``silu(gate) * up`` over ``x = [gate; up]`` ``[m, 2f]``, rounded to x's dtype (the value
        the unfused path stores), times ``scale``, saturated and cast, stored row-major into ``out [m,
        f]`` and transposed into ``out_t [f, m]``; the tile's max |value| into its slot of ``part_ptr``."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        mask = (rm[:, None] < m) & (rn[None, :] < f)
        a = tl.load(x_ptr + rm[:, None] * x_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + rm[:, None] * x_stride + f + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        y = (a * tl.sigmoid(a) * b).to(x_ptr.dtype.element_ty).to(tl.float32)
        store_cast_transpose(y, tl.load(scale_ptr), out_ptr, out_t_ptr, rm, rn, m, f, f, 0, FMAX)
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, tile_amax(y))

    @triton.jit
    def swiglu_bwd_cast_transpose_kernel(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        grad_ptr,
        x_ptr,
        scale_ptr,
        out_ptr,
        out_t_ptr,
        part_ptr,
        m,
        f,
        grad_stride,
        x_stride,
        FMAX: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        """SwiGLU's backward and fc1's gradient quantisation in one pass: for a ``[BM, BN]`` tile of
        ``grad [m, f]`` and the matching gate and up tiles of ``x [m, 2f]``, the two gradient tiles of
        ``d [m, 2f]`` (rounded to x's dtype, as the unfused path stores them), times ``scale``,
        saturated and cast, stored row-major into ``out [m, 2f]`` and transposed into ``out_t [2f, m]``;
        the tiles' max |d| into this program's slot of ``part_ptr``."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        mask = (rm[:, None] < m) & (rn[None, :] < f)
        g = tl.load(grad_ptr + rm[:, None] * grad_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + rm[:, None] * x_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + rm[:, None] * x_stride + f + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        d_gate, d_up = swiglu_grads(g, a, b)
        d_gate = d_gate.to(x_ptr.dtype.element_ty).to(tl.float32)
        d_up = d_up.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(scale_ptr)
        store_cast_transpose(d_gate, scale, out_ptr, out_t_ptr, rm, rn, m, f, 2 * f, 0, FMAX)
        store_cast_transpose(d_up, scale, out_ptr, out_t_ptr, rm, rn, m, f, 2 * f, f, FMAX)
        tl.store(
            part_ptr + pid_m * tl.num_programs(1) + pid_n, tl.maximum(tile_amax(d_gate), tile_amax(d_up))
        )


# (rows, columns, warps) of the two fused kernels' tiles: docs/performance.md, "The SwiGLU MLP as one
# FP8 block"
# (bench/bench_swiglu.py --fp8 measures them).
SWIGLU_CT_TILE = (64, 128, 4)
SWIGLU_BWD_CT_TILE = (128, 64, 8)

Fp8Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def swiglu_cast_transpose_amax_triton(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int, int] | None = None
) -> Fp8Triple:
    """The fused forward kernel on ``x [M, 2F]`` (CUDA, or CPU under the interpreter); ``tile``:
    (rows, columns, warps), default ``SWIGLU_CT_TILE``."""
    f = x.shape[-1] // 2
    x2 = rows(x, 2 * f)
    m = x2.shape[0]
    out = torch.empty((m, f), dtype=dtype, device=x.device)
    out_t = torch.empty((f, m), dtype=dtype, device=x.device)
    bm, bn, warps = tile or SWIGLU_CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bn))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    torch.library.wrap_triton(swiglu_cast_transpose_kernel)[grid](
        x2,
        scale.reshape(1),
        out,
        out_t,
        partials,
        m,
        f,
        x2.stride(0),
        FMAX=torch.finfo(dtype).max,
        BM=bm,
        BN=bn,
        num_warps=warps,
    )
    return out, out_t, partials.amax()


def swiglu_backward_cast_transpose_amax_triton(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    tile: tuple[int, int, int] | None = None,
) -> Fp8Triple:
    """The fused backward kernel on ``grad [M, F]`` and ``x [M, 2F]`` (CUDA, or CPU under the
    interpreter); ``tile``: (rows, columns, warps), default ``SWIGLU_BWD_CT_TILE``."""
    f = grad.shape[-1]
    g2, x2 = rows(grad, f), rows(x, 2 * f)
    m = g2.shape[0]
    out = torch.empty((m, 2 * f), dtype=dtype, device=grad.device)
    out_t = torch.empty((2 * f, m), dtype=dtype, device=grad.device)
    bm, bn, warps = tile or SWIGLU_BWD_CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bn))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=grad.device)
    torch.library.wrap_triton(swiglu_bwd_cast_transpose_kernel)[grid](
        g2,
        x2,
        scale.reshape(1),
        out,
        out_t,
        partials,
        m,
        f,
        g2.stride(0),
        x2.stride(0),
        FMAX=torch.finfo(dtype).max,
        BM=bm,
        BN=bn,
        num_warps=warps,
    )
    return out, out_t, partials.amax()


@op("megatron::swiglu_cast_transpose_amax")
def _swiglu_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Fp8Triple:
    return swiglu_cast_transpose_amax_triton(x, scale, dtype)


@op("megatron::swiglu_backward_cast_transpose_amax")
def _swiglu_backward_op(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> Fp8Triple:
    return swiglu_backward_cast_transpose_amax_triton(grad, x, scale, dtype)


def swiglu_cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, use_triton: bool
) -> Fp8Triple:
    """The cast-transpose and amax of ``silu(gate) * up`` over ``x = [gate; up]`` ``[M, 2F]`` (fc2's
    input in a SwiGLU MLP); with Triton in one pass, without writing the bf16 activation."""
    if use_triton:
        return _swiglu_op(x, scale, dtype)
    q, q_t, amax = fp8_cast_transpose_torch(swiglu_fp32(x.reshape(-1, x.shape[-1])), scale, dtype, True)
    return q, q_t, amax


def swiglu_backward_cast_transpose_amax(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, use_triton: bool
) -> Fp8Triple:
    """The cast-transpose and amax of SwiGLU's gradient for ``grad [M, F]``, ``x [M, 2F]`` (fc1's
    output gradient in a SwiGLU MLP); with Triton in one pass, without writing the bf16 gradient."""
    if use_triton:
        return _swiglu_backward_op(grad, x, scale, dtype)
    f = grad.shape[-1]
    q, q_t, amax = fp8_cast_transpose_torch(
        swiglu_backward_torch(grad.reshape(-1, f), x.reshape(-1, 2 * f)), scale, dtype, True
    )
    return q, q_t, amax


def fp8_codes_differ(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether two fp8 tensors differ by more than rare neighbouring codes (a bf16 value computed in
    one kernel or two, with sigmoid's last fp32 bit, may round the other way; +0 and -0 are equal)."""
    codes = (got.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs()
    diff = torch.where(got.float() == ref.float(), 0, codes)
    return bool(diff.max().item() > 1 or diff.count_nonzero().item() > diff.numel() // 1000)


def check_swiglu_fp8(device: torch.device) -> str:
    """The two fused kernels against the passes they replace: fp8 codes equal but for rare
    neighbours, amaxes equal to 1%."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(200, 2 * 300, device=device, generator=g) * 3).bfloat16()
    grad = torch.randn(200, 300, device=device, generator=g).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name, ref_t in (("forward", swiglu_fp32(x)), ("backward", swiglu_backward_torch(grad, x))):
            scale = torch.finfo(dtype).max / ref_t.float().abs().amax() * 1.5  # some values saturate
            ref = fp8_cast_transpose_torch(ref_t, scale, dtype, True)
            got = (
                swiglu_cast_transpose_amax_triton(x, scale, dtype)
                if name == "forward"
                else swiglu_backward_cast_transpose_amax_triton(grad, x, scale, dtype)
            )
            if any(fp8_codes_differ(a, b) for a, b in zip(got[:2], ref[:2])):
                return f"fused SwiGLU {name} + cast to {dtype} differs from the two passes"
            if not torch.allclose(got[2], ref[2], rtol=1e-2):
                return f"fused SwiGLU {name} + cast: amax differs"
    return ""
