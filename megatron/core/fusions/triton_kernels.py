"""Hand-written Triton kernels for two memory-bound steps Inductor does at about half the copy bandwidth.

* ``swiglu_backward``: the gradient of ``silu(gate) * up`` with respect to fc1's output ``[gate; up]``.
  Inductor lowers it as one kernel over the concatenated output whose two halves load their inputs
  separately (five loads per element pair instead of three); this kernel reads ``grad``, ``gate``
  and ``up`` once and writes both halves (8.8 ms per step for llama-3b's 26 layers on an H200 with
  Inductor; about 4 ms at the copy bandwidth).
* ``cross_entropy_grad_``: the fused cross entropy's per-row pass over ``[c, V]`` logits: an online
  log-sum-exp (running max and rescaled sum), the target logit, the fp32 loss, then the gradient
  ``w (softmax - onehot)`` written over the logits. One program per row, so the second read of a
  row mostly hits L2.

Both compute in fp32 and round once when storing, as Inductor's kernels do. They run on CUDA when
Triton is importable (it ships with CUDA builds of torch) and their one-time self-check on the
device (a small problem against the torch code) passes; otherwise, or after any failure, the torch
code that computes the same thing runs, with a warning; under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors,
which is how the tests check them without a GPU. ``swiglu_backward`` is a ``torch.library`` custom
op so that compiled layers call it as an opaque kernel.
"""

from __future__ import annotations

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

_FAILED: set[str] = set()
_CHECKED: set[str] = set()


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


def _fallback(kernel: str, exc: Exception) -> None:
    _FAILED.add(kernel)
    warnings.warn(f"Triton kernel {kernel} failed ({type(exc).__name__}: {exc}); using the torch code instead",
                  stacklevel=4)


def _run(kernel: str, triton_fn, torch_fn, *args: torch.Tensor):
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


_SELF_CHECKS = {"swiglu_backward": _check_swiglu, "cross_entropy_grad": _check_cross_entropy}


if triton is not None:

    @triton.jit
    def _swiglu_bwd_kernel(grad_ptr, x_ptr, dx_ptr, f, grad_stride, x_stride, dx_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        g = tl.load(grad_ptr + row * grad_stride + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_stride + f + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        d_gate = g * b * s * (1.0 + a * (1.0 - s))
        d_up = g * a * s
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
    _swiglu_bwd_kernel[grid](g2, x2, dx, f, g2.stride(0), x2.stride(0), dx.stride(0), BLOCK=block, num_warps=4)
    return dx.view(x.shape)


@torch.library.custom_op("megatron::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d(silu(gate) * up) / d[gate; up] for the incoming ``grad`` of ``silu(gate) * up``."""
    return _run("swiglu_backward", swiglu_backward_triton, _swiglu_backward_torch, grad, x)


@swiglu_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over ``x = [gate; up]``; backward through :func:`swiglu_backward`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

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
