"""FP8 quantisation for the scaled GEMMs (megatron/core/fusions/fp8), Transformer Engine's
cast-transpose: a tensor's fp8 copy row-major and transposed from one read (X8 and W8 for the forward
GEMM and, transposed, for the weight- and input-gradient GEMMs; dY8 for both gradient GEMMs),
optionally with the tensor's amax for delayed scaling's history, and a standalone amax reduction.

Each function takes ``use_triton`` (the run's :class:`TritonKernels` says ``fp8_cast``): the Triton
op, or the torch code that computes the same values bit for bit (the kernels' self-check compares
them). The ops are ``torch.library.triton_op``s, so compiled layers trace into them and Inductor
launches the kernels from its generated code; called eagerly, they run the same kernels.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.triton.common import op, tl, triton

# The cast-transpose's tile (rows, columns; 4 warps), autotuned: docs/performance.md, "Issue 6, sixth
# pass: FP8 gradient and activation casts in Triton".
CT_TILE = (64, 128)

if triton is not None:

    @triton.jit
    def amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        """``amax_ptr[0] = max(amax_ptr[0], max |x|)`` over ``n`` contiguous elements; each program
        strides over blocks and adds one atomic (NaN counts as inf, so its scale falls back to 1)."""
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
            acc = tl.maximum(acc, tl.where(a != a, float("inf"), a))
        tl.atomic_max(amax_ptr, tl.max(acc, 0))

    @triton.jit
    def tile_amax(x):  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        """max |x| over a 2-D tile (NaN counts as inf, so its scale falls back to 1)."""
        a = tl.abs(x)
        return tl.max(tl.max(tl.where(a != a, float("inf"), a), 1), 0)

    @triton.jit
    def store_cast_transpose(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        x,
        scale,
        out_ptr,
        out_t_ptr,
        rm,
        rn,
        m,
        n,
        out_stride,
        col0,
        FMAX: tl.constexpr,
    ):
        """``x * scale`` (a ``[rows rm, cols rn]`` tile, fp32) saturated to +-FMAX and cast, stored at
        columns ``col0 + rn`` of ``out [m, out_stride]`` and transposed at rows ``col0 + rn`` of
        ``out_t [out_stride, m]`` (both coalesced; the transpose goes through shared memory); ``n``:
        the valid columns of the tile's source."""
        y = x * scale
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y)).to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + rm[:, None] * out_stride + col0 + rn[None, :],
            y,
            mask=(rm[:, None] < m) & (rn[None, :] < n),
        )
        tl.store(
            out_t_ptr + (col0 + rn[:, None]) * m + rm[None, :],
            tl.trans(y),
            mask=(rn[:, None] < n) & (rm[None, :] < m),
        )

    @triton.jit
    def cast_transpose_kernel(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr
        x_ptr,
        scale_ptr,
        out_ptr,
        out_t_ptr,
        part_ptr,
        m,
        n,
        x_stride,
        FMAX: tl.constexpr,
        AMAX: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        """One ``[BM, BN]`` tile of ``x [m, n]``: ``x * scale`` saturated to +-FMAX and cast, stored
        row-major into ``out [m, n]`` and transposed into ``out_t [n, m]``; with AMAX, the tile's
        max |x| into its own slot of ``part_ptr`` (a store per tile, no atomics on one address)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        mask = (rm[:, None] < m) & (rn[None, :] < n)
        x = tl.load(x_ptr + rm[:, None] * x_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        store_cast_transpose(x, tl.load(scale_ptr), out_ptr, out_t_ptr, rm, rn, m, n, n, 0, FMAX)
        if AMAX:
            tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, tile_amax(x))


# ------------------------------------------------------------------------------------------------
# The torch code (the reference, and the path without Triton).


def fp8_amax_torch(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as an fp32 scalar, NaN reported as inf."""
    a = t.detach().abs().amax().float()
    return torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)


def fp8_cast_transpose_torch(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, with_amax: bool
) -> tuple[torch.Tensor, ...]:
    """``(q, q transposed[, amax])``: ``t * scale`` saturated and cast, as the kernel computes it."""
    fmax = torch.finfo(dtype).max
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return (q, q.t().contiguous(), fp8_amax_torch(t)) if with_amax else (q, q.t().contiguous())


# ------------------------------------------------------------------------------------------------
# The kernels' wrappers (CUDA, or CPU under the interpreter).


def fp8_amax_triton(t: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_amax_torch` by the amax kernel."""
    flat = t.contiguous().reshape(-1)
    out = torch.zeros((), dtype=torch.float32, device=t.device)
    block = 4096
    sm_count = torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 1
    programs = max(1, min(triton.cdiv(flat.numel(), block), 4 * sm_count))
    torch.library.wrap_triton(amax_kernel)[(programs,)](flat, out, flat.numel(), BLOCK=block, num_warps=8)
    return out


def fp8_cast_transpose_triton(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, with_amax: bool
) -> tuple[torch.Tensor, ...]:
    """The cast-transpose kernel on ``t [M, N]`` (rows may be strided)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    m, n = t.shape
    out = torch.empty((m, n), dtype=dtype, device=t.device)
    out_t = torch.empty((n, m), dtype=dtype, device=t.device)
    bm, bn = CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    partials = torch.empty(grid[0] * grid[1] if with_amax else 1, dtype=torch.float32, device=t.device)
    torch.library.wrap_triton(cast_transpose_kernel)[grid](
        t,
        scale.reshape(1),
        out,
        out_t,
        partials,
        m,
        n,
        t.stride(0),
        FMAX=torch.finfo(dtype).max,
        AMAX=with_amax,
        BM=bm,
        BN=bn,
        num_warps=4,
    )
    return (out, out_t, partials.amax()) if with_amax else (out, out_t)


@op("megatron::fp8_amax")
def _amax_op(t: torch.Tensor) -> torch.Tensor:
    return fp8_amax_triton(t)


@op("megatron::fp8_cast_transpose")
def _cast_transpose_op(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_t = fp8_cast_transpose_triton(t, scale, dtype, False)
    return q, q_t


@op("megatron::fp8_cast_transpose_amax")
def _cast_transpose_amax_op(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, q_t, amax = fp8_cast_transpose_triton(t, scale, dtype, True)
    return q, q_t, amax


# ------------------------------------------------------------------------------------------------
# What the FP8 GEMMs call.


def fp8_amax(t: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """``max |t|`` as an fp32 scalar (NaN reported as inf: either way the scale falls back to 1)."""
    return _amax_op(t) if use_triton else fp8_amax_torch(t)


def fp8_cast_transpose(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, N] * scale`` (fp32 scalar) saturated and cast to ``dtype`` (fp8): row-major ``[M, N]``
    and transposed ``[N, M]``, both contiguous."""
    if use_triton:
        return _cast_transpose_op(t, scale, dtype)
    q, q_t = fp8_cast_transpose_torch(t, scale, dtype, False)
    return q, q_t


def fp8_cast_transpose_amax(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_transpose` and ``max |t|`` as an fp32 scalar from the same pass (NaN as inf)."""
    if use_triton:
        return _cast_transpose_amax_op(t, scale, dtype)
    q, q_t, amax = fp8_cast_transpose_torch(t, scale, dtype, True)
    return q, q_t, amax


def check_fp8_cast(device: torch.device) -> str:
    """The amax and cast-transpose kernels against the torch code: bit-equal casts, equal amaxes."""
    g = torch.Generator(device=device).manual_seed(0)
    t = (torch.randn(200, 300, device=device, generator=g) * 5).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.finfo(dtype).max / t.float().abs().amax() * 1.5  # some values saturate
        for with_amax in (True, False):
            got = fp8_cast_transpose_triton(t, scale, dtype, with_amax)
            ref = fp8_cast_transpose_torch(t, scale, dtype, with_amax)
            if len(got) != len(ref) or not all(torch.equal(a.float(), b.float()) for a, b in zip(got, ref)):
                return f"fp8 cast-transpose to {dtype} differs from the torch code"
    if not torch.equal(fp8_amax_triton(t), fp8_amax_torch(t)):
        return "fp8 amax differs from the torch code"
    return ""
