"""Hand-written Triton kernels for memory-bound steps Inductor does at about half the copy bandwidth.

* ``swiglu_backward``: the gradient of ``silu(gate) * up`` with respect to fc1's output ``[gate; up]``.
  Inductor lowers it as one kernel over the concatenated output whose two halves load their inputs
  separately (five loads per element pair instead of three); this kernel reads ``grad``, ``gate``
  and ``up`` once and writes both halves (8.8 ms per step for llama-3b's 26 layers on an H200 with
  Inductor; about 4 ms at the copy bandwidth).
* ``cross_entropy_grad_``: the fused cross entropy's per-row pass over ``[c, V]`` logits: an online
  log-sum-exp (running max and rescaled sum), the target logit, the fp32 loss, then the gradient
  ``w (softmax - onehot)`` written over the logits. One program per row, so the second read of a
  row mostly hits L2.
* ``fp8_cast_transpose`` (``_amax``) and ``fp8_amax``: the FP8 linears' quantisation (fp8.py), the
  fp8 tensor and its transpose from one read (the layouts the forward and the two backward GEMMs
  read), with delayed scaling's amax from the same pass; Inductor computed a large tensor's amax at a
  third of the copy bandwidth and wrote transposed fp8 copies byte by byte.
* ``swiglu_cast_transpose_amax`` and ``swiglu_backward_cast_transpose_amax``: the FP8 SwiGLU MLP's
  two quantisations folded into the passes that compute their inputs: SwiGLU's output straight to
  fp8 (fc2's input, both layouts) and SwiGLU's gradient straight to fp8 (fc1's output gradient), so
  neither bf16 tensor is written and read back (llama-3b: [8192, 8192] and [8192, 16384] a layer).

All compute in fp32 and round once when storing, as Inductor's kernels do. They run on CUDA when
Triton is importable (it ships with CUDA builds of torch) and their one-time self-check on the
device (a small problem against the torch code) passes; otherwise, or after any failure, the torch
code that computes the same thing runs, with a warning; under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors,
which is how the tests check them without a GPU. ``swiglu_backward`` and the FP8 ones are
``torch.library.triton_op``s: compiled layers trace into them and Inductor launches the kernels from
its generated code (their one-time self-check runs before the compile: :func:`prepare_kernels`).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

_FAILED: set[str] = set()
_CHECKED: set[str] = set()


def _op(name: str):
    """``torch.library.triton_op(name)``. Without Triton installed, registering one makes torch scan
    the body for kernels and log "Triton not available" once per op on every process, though the op
    then only ever runs its torch code; the scan runs with that logger quiet."""
    def register(fn):
        if triton is not None:
            return triton_op(name, mutates_args=())(fn)
        log = logging.getLogger("torch._library.triton")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return triton_op(name, mutates_args=())(fn)
        finally:
            log.setLevel(level)
    return register


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(t: torch.Tensor, kernel: str) -> bool:
    """Whether ``kernel`` runs for ``t``: Triton importable, a CUDA tensor (or the interpreter), no
    earlier failure of that kernel in this process, and, on a GPU, its one-time self-check passed."""
    if triton is None or kernel in _FAILED or not (t.is_cuda or interpreting()):
        return False
    if t.is_cuda and kernel not in _CHECKED:
        _CHECKED.add(kernel)
        try:
            mismatch = _SELF_CHECKS[kernel](t.device)
        except Exception as exc:  # noqa: BLE001 - a compiler/driver failure: fall back, say so once
            _fallback(kernel, exc)
            return False
        if mismatch:
            _FAILED.add(kernel)
            warnings.warn(f"Triton kernel {kernel} disagrees with the torch code on this device ({mismatch}); "
                          "using the torch code instead", stacklevel=2)
            return False
    return True


def ready(t: torch.Tensor, kernel: str) -> bool:
    """:func:`available` for the ``triton_op`` bodies, which torch.compile traces with fake tensors:
    while tracing, only a kernel whose self-check already passed on this device (see
    :func:`prepare_kernels`); the check itself cannot run on fake tensors."""
    if torch.compiler.is_compiling() or is_fake(t):  # (the interpreter's kernels cannot be traced: CPU -> torch)
        return triton is not None and kernel not in _FAILED and t.is_cuda and kernel in _CHECKED
    return available(t, kernel)


def prepare_kernels(device: torch.device) -> None:
    """Compile and self-check, on ``device`` and now, the kernels that compiled code calls (SwiGLU
    backward, the FP8 casts): a compile traced before their check would use the torch code."""
    probe = torch.empty(0, device=device)
    for kernel in ("swiglu_backward", "fp8_cast", "swiglu_fp8"):
        available(probe, kernel)


def _fallback(kernel: str, exc: Exception) -> None:
    _FAILED.add(kernel)
    warnings.warn(f"Triton kernel {kernel} failed ({type(exc).__name__}: {exc}); using the torch code instead",
                  stacklevel=4)


def _run(kernel: str, triton_fn, torch_fn, *args):
    """``triton_fn(*args)`` where ``kernel`` is available for ``args[0]``, else (or after it fails,
    which is said once) ``torch_fn(*args)``, which computes the same thing."""
    if available(args[0], kernel):
        try:
            return triton_fn(*args)
        except Exception as exc:  # noqa: BLE001 - a compiler/driver failure: fall back, say so once
            _fallback(kernel, exc)
    return torch_fn(*args)


def _check_swiglu(device: torch.device) -> str:
    """'' when the kernel matches the torch code on a small problem on ``device``, else what differs."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(64, 2 * 1000, device=device, generator=g) * 3).bfloat16()
    grad = torch.randn(64, 1000, device=device, generator=g).bfloat16()
    return _compare(swiglu_backward_triton(grad, x), _swiglu_backward_torch(grad, x))


def _compare(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> str:
    """'' when ``|got - ref| <= tol * (1 + |ref|)`` everywhere (bf16 rounding), else the worst excess."""
    excess = ((got.float() - ref.float()).abs() - tol * (1.0 + ref.float().abs())).max().item()
    return "" if excess <= 0.0 else f"difference exceeds the bf16 tolerance by {excess:.3g}"


def _check_cross_entropy(device: torch.device) -> str:
    from megatron.core.fusions.linear_cross_entropy import _loss_and_dlogits_

    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(16, 5000, device=device, generator=g) * 4).bfloat16()
    target = torch.randint(0, 5000, (16,), device=device, generator=g)
    weights = torch.ones(16, device=device)
    ref, got = logits.clone(), logits.clone()
    loss = cross_entropy_grad_triton(got, target, weights)
    return _compare(loss, _loss_and_dlogits_(ref, target, weights), tol=1e-4) or _compare(got, ref)


def _check_fp8_cast(device: torch.device) -> str:
    """The FP8 amax and cast-transpose kernels against the torch code: bit-equal casts, equal amaxes."""
    g = torch.Generator(device=device).manual_seed(0)
    t = (torch.randn(200, 300, device=device, generator=g) * 5).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.finfo(dtype).max / t.float().abs().amax() * 1.5  # some values saturate
        for with_amax in (True, False):
            got = fp8_cast_transpose_triton(t, scale, dtype, with_amax)
            ref = _fp8_cast_transpose_torch(t, scale, dtype, with_amax)
            if len(got) != len(ref) or not all(torch.equal(a.float(), b.float()) for a, b in zip(got, ref)):
                return f"fp8 cast-transpose to {dtype} differs from the torch code"
    if not torch.equal(fp8_amax_triton(t), _fp8_amax_torch(t)):
        return "fp8 amax differs from the torch code"
    return ""


def _fp8_codes_differ(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether two fp8 tensors differ by more than rare neighbouring codes (a bf16 value computed in
    one kernel or two, with sigmoid's last fp32 bit, may round the other way; +0 and -0 are equal)."""
    codes = (got.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs()
    diff = torch.where(got.float() == ref.float(), 0, codes)
    return diff.max().item() > 1 or diff.count_nonzero().item() > diff.numel() // 1000


def _check_swiglu_fp8(device: torch.device) -> str:
    """The two fused SwiGLU + cast-transpose kernels against the passes they replace: fp8 codes equal
    but for rare neighbours, amaxes equal to 1%."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(200, 2 * 300, device=device, generator=g) * 3).bfloat16()
    grad = torch.randn(200, 300, device=device, generator=g).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name, ref_t in (("forward", _swiglu_torch(x)), ("backward", _swiglu_backward_torch(grad, x))):
            scale = torch.finfo(dtype).max / ref_t.float().abs().amax() * 1.5  # some values saturate
            ref = _fp8_cast_transpose_torch(ref_t, scale, dtype, True)
            got = (swiglu_cast_transpose_amax_triton(x, scale, dtype) if name == "forward" else
                   swiglu_backward_cast_transpose_amax_triton(grad, x, scale, dtype))
            if any(_fp8_codes_differ(a, b) for a, b in zip(got[:2], ref[:2])):
                return f"fused SwiGLU {name} + cast to {dtype} differs from the two passes"
            if not torch.allclose(got[2], ref[2], rtol=1e-2):
                return f"fused SwiGLU {name} + cast: amax differs"
    return ""


_SELF_CHECKS = {"swiglu_backward": _check_swiglu, "cross_entropy_grad": _check_cross_entropy,
                "fp8_cast": _check_fp8_cast, "swiglu_fp8": _check_swiglu_fp8}


if triton is not None:

    @triton.jit
    def _swiglu_grads(g, a, b):
        """``(d gate, d up)`` of ``silu(a) * b`` for the incoming gradient ``g`` (fp32)."""
        s = tl.sigmoid(a)
        return g * b * s * (1.0 + a * (1.0 - s)), g * a * s

    @triton.jit
    def _swiglu_bwd_kernel(grad_ptr, x_ptr, dx_ptr, f, grad_stride, x_stride, dx_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        g = tl.load(grad_ptr + row * grad_stride + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_stride + f + cols, mask=mask, other=0.0).to(tl.float32)
        d_gate, d_up = _swiglu_grads(g, a, b)
        out = dx_ptr + row * dx_stride
        tl.store(out + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(out + f + cols, d_up.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ce_grad_kernel(logits_ptr, stride, target_ptr, weight_ptr, loss_ptr, v, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(target_ptr + row)
        w = tl.load(weight_ptr + row).to(tl.float32)
        # Pass 1: online log-sum-exp. Per lane a running max and a sum rescaled to it.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            # Lanes that have seen only -inf keep 0 (exp(-inf - -inf) would be nan).
            acc = tl.where(new_m == float("-inf"), 0.0, acc * tl.exp(m - new_m) + tl.exp(x - new_m))
            m = new_m
        row_max = tl.max(m, 0)
        total = tl.sum(acc * tl.exp(m - row_max), 0)
        lse = row_max + tl.log(total)
        picked = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - picked)
        # Pass 2: the gradient over the logits, in place.
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < v
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == target, p - 1.0, p)
            tl.store(base + cols, (p * w).to(logits_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
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
    def _cast_transpose_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, part_ptr, m, n, x_stride,
                               FMAX: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """One ``[BM, BN]`` tile of ``x [m, n]``: ``x * scale`` saturated to +-FMAX and cast, stored
        row-major into ``out [m, n]`` and transposed into ``out_t [n, m]`` (both coalesced; the
        transpose goes through shared memory); with AMAX, the tile's max |x| into its slot of
        ``part_ptr`` (a per-tile store: one atomic per tile on one address serialised them)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        mask = (rm[:, None] < m) & (rn[None, :] < n)
        x = tl.load(x_ptr + rm[:, None] * x_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        _store_cast_transpose(x, tl.load(scale_ptr), out_ptr, out_t_ptr, rm, rn, m, n, n, 0, FMAX)
        if AMAX:
            tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, _tile_amax(x))

    @triton.jit
    def _tile_amax(x):
        """max |x| over a 2-D tile (NaN counts as inf, so its scale falls back to 1)."""
        a = tl.abs(x)
        return tl.max(tl.max(tl.where(a != a, float("inf"), a), 1), 0)

    @triton.jit
    def _store_cast_transpose(x, scale, out_ptr, out_t_ptr, rm, rn, m, n, out_stride, col0, FMAX: tl.constexpr):
        """``x * scale`` (a ``[rows rm, cols rn]`` tile, fp32) saturated to +-FMAX and cast, stored at
        columns ``col0 + rn`` of ``out [m, out_stride]`` and transposed at rows ``col0 + rn`` of
        ``out_t [out_stride, m]`` (both coalesced; the transpose goes through shared memory); ``n``:
        the valid columns of the tile's source."""
        y = x * scale
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[:, None] * out_stride + col0 + rn[None, :], y, mask=(rm[:, None] < m) & (rn[None, :] < n))
        tl.store(out_t_ptr + (col0 + rn[:, None]) * m + rm[None, :], tl.trans(y),
                 mask=(rn[:, None] < n) & (rm[None, :] < m))

    @triton.jit
    def _swiglu_cast_transpose_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, part_ptr, m, f, x_stride,
                                      FMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
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
        _store_cast_transpose(y, tl.load(scale_ptr), out_ptr, out_t_ptr, rm, rn, m, f, f, 0, FMAX)
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, _tile_amax(y))

    @triton.jit
    def _swiglu_bwd_cast_transpose_kernel(grad_ptr, x_ptr, scale_ptr, out_ptr, out_t_ptr, part_ptr, m, f,
                                          grad_stride, x_stride, FMAX: tl.constexpr, BM: tl.constexpr,
                                          BN: tl.constexpr):
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
        d_gate, d_up = _swiglu_grads(g, a, b)
        d_gate = d_gate.to(x_ptr.dtype.element_ty).to(tl.float32)
        d_up = d_up.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(scale_ptr)
        _store_cast_transpose(d_gate, scale, out_ptr, out_t_ptr, rm, rn, m, f, 2 * f, 0, FMAX)
        _store_cast_transpose(d_up, scale, out_ptr, out_t_ptr, rm, rn, m, f, 2 * f, f, FMAX)
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, tl.maximum(_tile_amax(d_gate), _tile_amax(d_up)))


def _swiglu_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 and rounded once, as Inductor's fused kernel does."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _swiglu_backward_torch(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    g = grad.float()
    s = torch.sigmoid(a)
    return torch.cat((g * b * s * (1.0 + a * (1.0 - s)), g * a * s), dim=-1).to(x.dtype)


def swiglu_backward_triton(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on ``grad [..., F]`` and ``x [..., 2F]`` (CUDA, or CPU under the interpreter)."""
    f = grad.shape[-1]
    g2 = grad.reshape(-1, f)
    x2 = x.reshape(-1, 2 * f)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dx = torch.empty((x2.shape[0], 2 * f), dtype=x.dtype, device=x.device)
    block = 1024
    grid = (x2.shape[0], triton.cdiv(f, block))
    wrap_triton(_swiglu_bwd_kernel)[grid](g2, x2, dx, f, g2.stride(0), x2.stride(0), dx.stride(0), BLOCK=block,
                                          num_warps=4)
    return dx.view(x.shape)


@_op("megatron::swiglu_backward")
def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d(silu(gate) * up) / d[gate; up] for the incoming ``grad`` of ``silu(gate) * up``."""
    if ready(grad, "swiglu_backward"):
        return swiglu_backward_triton(grad, x)
    return _swiglu_backward_torch(grad, x)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over ``x = [gate; up]``; backward through :func:`swiglu_backward`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _swiglu_torch(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return swiglu_backward(grad, x)


def cross_entropy_grad_triton(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 per-row loss of ``logits [c, V]``; overwrites them with ``weights[:, None] * (softmax - onehot)``."""
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_grad_triton needs logits with a contiguous last dim")
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    block = 4096 if v >= 4096 else triton.next_power_of_2(v)
    _ce_grad_kernel[(c,)](logits, logits.stride(0), target.contiguous(), weights.float().contiguous(), loss, v,
                          BLOCK=block, num_warps=16 if block >= 4096 else 4)
    return loss


def cross_entropy_grad_(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, fallback) -> torch.Tensor:
    """The Triton pass where it runs, else ``fallback(logits, target, weights)`` (same contract)."""
    return _run("cross_entropy_grad", cross_entropy_grad_triton, fallback, logits, target, weights)


# ------------------------------------------------------------------------------------------------
# FP8 quantisation for the scaled GEMMs (fp8.py), Transformer Engine's cast-transpose: a tensor's fp8
# copy row-major and transposed in one pass (X8 and W8 for the forward GEMM and, transposed, for the
# weight- and input-gradient GEMMs; dY8 for both gradient GEMMs), optionally with the tensor's amax
# for delayed scaling's history.

def _fp8_amax_torch(t: torch.Tensor) -> torch.Tensor:
    a = t.detach().abs().amax().float()
    return torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_amax_triton(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    out = torch.zeros((), dtype=torch.float32, device=t.device)
    block = 4096
    programs = max(1, min(triton.cdiv(flat.numel(), block), 4 * _sm_count(t.device) if t.is_cuda else 4))
    wrap_triton(_amax_kernel)[(programs,)](flat, out, flat.numel(), BLOCK=block, num_warps=8)
    return out


def fp8_cast_transpose_triton(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                              with_amax: bool) -> tuple[torch.Tensor, ...]:
    """The cast-transpose kernel on ``t [M, N]`` (rows may be strided; CUDA, or CPU under the interpreter)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    m, n = t.shape
    out = torch.empty((m, n), dtype=dtype, device=t.device)
    out_t = torch.empty((n, m), dtype=dtype, device=t.device)
    bm, bn = CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    partials = torch.empty(grid[0] * grid[1] if with_amax else 1, dtype=torch.float32, device=t.device)
    wrap_triton(_cast_transpose_kernel)[grid](t, scale.reshape(1), out, out_t, partials, m, n, t.stride(0),
                                              FMAX=torch.finfo(dtype).max, AMAX=with_amax, BM=bm, BN=bn,
                                              num_warps=4)
    return (out, out_t, partials.amax()) if with_amax else (out, out_t)


# The tile of the cast-transpose (rows, columns; 4 warps): what Triton's autotuner chose on an H200 for
# the large llama-3b shapes among six (docs/performance.md, sixth pass).
CT_TILE = (64, 128)


def _fp8_cast_transpose_torch(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                              with_amax: bool) -> tuple[torch.Tensor, ...]:
    fmax = torch.finfo(dtype).max
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return (q, q.t().contiguous(), _fp8_amax_torch(t)) if with_amax else (q, q.t().contiguous())


# ``torch.library.triton_op``: torch.compile traces into these and Inductor launches the Triton kernels
# from its generated code like its own (a ``custom_op`` cost ~0.2 ms of host time per call, 312 calls a
# step, and the GPU waited for it: docs/performance.md, sixth pass). Called eagerly, they run the same.

def _cast_transpose(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, with_amax: bool) -> tuple[torch.Tensor, ...]:
    """The two cast-transpose ops' body: the kernel where it is ready, else the torch code."""
    if ready(t, "fp8_cast"):
        return fp8_cast_transpose_triton(t, scale, dtype, with_amax)
    return _fp8_cast_transpose_torch(t, scale, dtype, with_amax)


@_op("megatron::fp8_amax")
def fp8_amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as an fp32 scalar (NaN reported as inf: either way the scale falls back to 1)."""
    return fp8_amax_triton(t) if ready(t, "fp8_cast") else _fp8_amax_torch(t)


@_op("megatron::fp8_cast_transpose")
def fp8_cast_transpose(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, N] * scale`` (fp32 scalar) saturated and cast to ``dtype`` (fp8): row-major ``[M, N]``
    and transposed ``[N, M]``, both contiguous."""
    q, q_t = _cast_transpose(t, scale, dtype, False)
    return q, q_t


@_op("megatron::fp8_cast_transpose_amax")
def fp8_cast_transpose_amax(t: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_transpose` and ``max |t|`` as an fp32 scalar from the same pass (NaN as inf)."""
    q, q_t, amax = _cast_transpose(t, scale, dtype, True)
    return q, q_t, amax


# ------------------------------------------------------------------------------------------------
# The FP8 SwiGLU MLP's quantisations inside SwiGLU's own passes (fp8.py, _Fp8SwigluMlpDelayed): the
# activation's output and fc1's output gradient go straight to fp8 in both layouts.

# (rows, columns, warps) of the two fused kernels' tiles: the fastest of eight on an H200 over llama-3b's and
# Llama-3-8B's shapes (bench/bench_swiglu.py --fp8; docs/performance.md, eleventh pass).
SWIGLU_CT_TILE = (64, 128, 4)
SWIGLU_BWD_CT_TILE = (128, 64, 8)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu_cast_transpose_amax_triton(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                                      tile: tuple[int, int, int] | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused forward kernel on ``x [M, 2F]`` (CUDA, or CPU under the interpreter); ``tile``:
    (rows, columns, warps), default ``SWIGLU_CT_TILE``."""
    f = x.shape[-1] // 2
    x2 = _rows(x, 2 * f)
    m = x2.shape[0]
    out = torch.empty((m, f), dtype=dtype, device=x.device)
    out_t = torch.empty((f, m), dtype=dtype, device=x.device)
    bm, bn, warps = tile or SWIGLU_CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bn))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    wrap_triton(_swiglu_cast_transpose_kernel)[grid](x2, scale.reshape(1), out, out_t, partials, m, f, x2.stride(0),
                                                     FMAX=torch.finfo(dtype).max, BM=bm, BN=bn, num_warps=warps)
    return out, out_t, partials.amax()


def swiglu_backward_cast_transpose_amax_triton(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                                               dtype: torch.dtype, tile: tuple[int, int, int] | None = None
                                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward kernel on ``grad [M, F]`` and ``x [M, 2F]`` (CUDA, or CPU under the
    interpreter); ``tile``: (rows, columns, warps), default ``SWIGLU_BWD_CT_TILE``."""
    f = grad.shape[-1]
    g2, x2 = _rows(grad, f), _rows(x, 2 * f)
    m = g2.shape[0]
    out = torch.empty((m, 2 * f), dtype=dtype, device=grad.device)
    out_t = torch.empty((2 * f, m), dtype=dtype, device=grad.device)
    bm, bn, warps = tile or SWIGLU_BWD_CT_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bn))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=grad.device)
    wrap_triton(_swiglu_bwd_cast_transpose_kernel)[grid](g2, x2, scale.reshape(1), out, out_t, partials, m, f,
                                                         g2.stride(0), x2.stride(0), FMAX=torch.finfo(dtype).max,
                                                         BM=bm, BN=bn, num_warps=warps)
    return out, out_t, partials.amax()


@_op("megatron::swiglu_cast_transpose_amax")
def swiglu_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_transpose_amax` of ``silu(gate) * up`` over ``x = [gate; up]`` ``[M, 2F]``
    (fc2's input in a SwiGLU MLP), in one pass without writing the bf16 activation."""
    if ready(x, "swiglu_fp8"):
        return swiglu_cast_transpose_amax_triton(x, scale, dtype)
    q, q_t, amax = _fp8_cast_transpose_torch(_swiglu_torch(x.reshape(-1, x.shape[-1])), scale, dtype, True)
    return q, q_t, amax


@_op("megatron::swiglu_backward_cast_transpose_amax")
def swiglu_backward_cast_transpose_amax(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_transpose_amax` of :func:`swiglu_backward` ``(grad [M, F], x [M, 2F])`` (fc1's
    output gradient in a SwiGLU MLP), in one pass without writing the bf16 gradient."""
    if ready(grad, "swiglu_fp8"):
        return swiglu_backward_cast_transpose_amax_triton(grad, x, scale, dtype)
    f = grad.shape[-1]
    q, q_t, amax = _fp8_cast_transpose_torch(_swiglu_backward_torch(grad.reshape(-1, f), x.reshape(-1, 2 * f)),
                                             scale, dtype, True)
    return q, q_t, amax
