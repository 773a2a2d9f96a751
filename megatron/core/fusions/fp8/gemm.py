"""The FP8 GEMM of one linear, ``Y [M, N] = X [M, K] W [N, K]^T``, as autograd functions.

The forward quantises ``X`` and ``W`` to e4m3 with one fp32 scale per tensor; the backward quantises
``dY`` (e5m2 for ``hybrid``, e4m3 for ``e4m3``) and computes ``dX = dY W`` and ``dW = dY^T X`` in
FP8 too. The quantisation is the cast-transpose (:mod:`megatron.core.fusions.triton.fp8_cast`: the
fp8 copy and its transpose in one pass, the layouts the three GEMMs read; the Triton kernel where
the run's plan enabled ``fp8_cast``, else the torch code, bit for bit the same), then
:func:`scaled_mm`. The scales follow :mod:`.scaling`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.fusions.fp8.recipe import DY, Fp8Recipe, W, X
from megatron.core.fusions.fp8.scaling import (
    current_amax,
    delayed_scale,
    history_amax,
    quantize,
    scale_from_amax,
    scaled_mm,
)
from megatron.core.fusions.triton.fp8_cast import fp8_amax, fp8_cast_transpose, fp8_cast_transpose_amax

Fp8Cast = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def cast_delayed(
    t: torch.Tensor,
    past: torch.Tensor,
    initialized: torch.Tensor,
    dtype: torch.dtype,
    warm: bool,
    use_triton: bool,
    triton_amax: bool,
) -> Fp8Cast:
    """``(t8, t8 transposed, amax of t, scale)`` with delayed scaling, ``past`` being the amax read
    from the history. ``warm`` (known on the host: the history has entries) takes the scale from it
    alone, so the cast, the transpose and the amax are one pass over ``t``; before that the scale may
    be the current amax, computed first (``triton_amax``: by the amax op, else by torch ops that
    Inductor fuses with t's producer)."""
    if warm:
        scale = delayed_scale(past, None, None, dtype)
        t8, t8_t, amax = fp8_cast_transpose_amax(t, scale, dtype, use_triton)
    else:
        amax = fp8_amax(t, use_triton) if triton_amax else current_amax(t)
        scale = delayed_scale(past, initialized, amax, dtype)
        t8, t8_t = fp8_cast_transpose(t, scale, dtype, use_triton)
    return t8, t8_t, amax, scale


def fp8_grads(
    ctx: Any,
    dy8: torch.Tensor,
    dy8_t: torch.Tensor,
    g_inv: torch.Tensor,
    x8_t: torch.Tensor,
    w8_t: torch.Tensor,
    x_inv: torch.Tensor,
    w_inv: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The FP8 backward GEMMs ``dX = dY8 W8`` [M, K] and ``dW = dY8^T X8`` [N, K] (``dy8_t``, ``x8_t``
    and ``w8_t``: the fp8 tensors transposed, contiguous, as the cast-transposes wrote them: the
    layouts ``_scaled_mm`` reads), each only where autograd needs it (``ctx.needs_input_grad`` of x
    and weight)."""
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = scaled_mm(dy8, w8_t.t(), g_inv, w_inv, ctx.dtypes[0], ctx.use_scaled_mm)
    if ctx.needs_input_grad[1]:
        dw = scaled_mm(dy8_t, x8_t.t(), g_inv, x_inv, ctx.dtypes[1], ctx.use_scaled_mm)
    return dx, dw


class _Fp8Matmul(torch.autograd.Function):
    """Current (tensorwise) scaling: every tensor's scale from its own amax.

    Forward: X, W -> e4m3; ``Y = _scaled_mm(X8, W8^T)`` in X's dtype. Backward: dY -> the gradient
    format; ``dX = dY8 W8`` and ``dW = dY8^T X8`` (the saved fp8 copies of W and of X transposed,
    written by the forward's cast-transpose: X is kept at one byte per element, in the layout the
    weight-gradient GEMM reads).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        recipe: Fp8Recipe,
        use_scaled_mm: bool,
        use_triton: bool,
    ) -> torch.Tensor:
        fwd = recipe.fwd_dtype
        x_scale = scale_from_amax(current_amax(x), fwd)
        w_scale = scale_from_amax(current_amax(weight), fwd)
        x8, x8_t = fp8_cast_transpose(x, x_scale, fwd, use_triton)  # [M, K] and [K, M]
        w8, w8_t = fp8_cast_transpose(weight, w_scale, fwd, use_triton)  # [N, K] and [K, N]
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, use_scaled_mm, fast_accum=True)  # [M, N]
        ctx.save_for_backward(x8_t, w8_t, x_inv, w_inv)
        ctx.recipe, ctx.use_scaled_mm, ctx.use_triton = recipe, use_scaled_mm, use_triton
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8_t, w8_t, x_inv, w_inv = ctx.saved_tensors
        bwd = ctx.recipe.bwd_dtype
        dy = grad_out.contiguous()  # [M, N]
        g_scale = scale_from_amax(fp8_amax(dy, ctx.use_triton), bwd)  # the amax pass, then the cast-transpose
        dy8, dy8_t = fp8_cast_transpose(dy, g_scale, bwd, ctx.use_triton)
        return (*fp8_grads(ctx, dy8, dy8_t, g_scale.reciprocal(), x8_t, w8_t, x_inv, w_inv), None, None, None)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    use_scaled_mm: bool = True,
    use_triton: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` in FP8 with current (tensorwise) scaling (see :class:`_Fp8Matmul`);
    M, N, K multiples of 16. Delayed scaling is :class:`Fp8Gemm`'s (it holds the history)."""
    out: torch.Tensor = _Fp8Matmul.apply(x, weight, recipe, use_scaled_mm, use_triton)
    return out


class Fp8MatmulDelayed(torch.autograd.Function):
    """Delayed scaling, with nothing written inside, so that it compiles into the layers' graphs and
    an activation-recompute replay of the forward computes exactly what the original forward did:

    * forward: the scales of ``x`` and ``w`` come from the history (read only; the current amax
      before the first entry); their current amaxes are saved;
    * backward: the gradient's scale likewise from the history values read in forward; the three
      current amaxes ``[x, w, dy]`` leave as the gradient of ``amax_sink``, a leaf tensor whose
      post-accumulate hook (:class:`Fp8Gemm`) records them, outside any graph.

    So a forward's amaxes enter the history when its backward has run (the next forward sees them);
    a forward without backward (evaluation) records nothing.

    ``warm`` (a host bool: the history has entries) drops the device-side choice between history and
    current amax, the same values from then on: no cast waits for its tensor's amax reduction, and
    each tensor's cast, transpose and amax are one pass. A compiled layer recompiles once, when it
    turns True.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        amax_sink: torch.Tensor,
        history: torch.Tensor,
        initialized: torch.Tensor,
        recipe: Fp8Recipe,
        use_scaled_mm: bool,
        warm: bool,
        use_triton: bool,
    ) -> torch.Tensor:
        fwd, algo = recipe.fwd_dtype, recipe.amax_compute_algo
        x8, x8_t, x_amax, x_scale = cast_delayed(
            x, history_amax(history[X], algo), initialized[X], fwd, warm, use_triton, False
        )
        w8, w8_t, w_amax, w_scale = cast_delayed(
            weight, history_amax(history[W], algo), initialized[W], fwd, warm, use_triton, False
        )
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, use_scaled_mm, fast_accum=True)
        dy_past = history_amax(history[DY], algo)
        ctx.save_for_backward(
            x8_t, w8_t, x_inv, w_inv, dy_past.clone(), initialized[DY].clone(), torch.stack((x_amax, w_amax))
        )
        ctx.recipe, ctx.use_scaled_mm, ctx.dtypes, ctx.warm = (
            recipe,
            use_scaled_mm,
            (x.dtype, weight.dtype),
            warm,
        )
        ctx.use_triton = use_triton
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8_t, w8_t, x_inv, w_inv, dy_past, dy_initialized, xw_amax = ctx.saved_tensors
        bwd = ctx.recipe.bwd_dtype
        # the gradient's amax, where the history is not yet warm, by the amax op (dY comes from opaque
        # kernels such as the SwiGLU backward, so Inductor has no producer to fuse it with)
        dy8, dy8_t, cur, g_scale = cast_delayed(
            grad_out.contiguous(), dy_past, dy_initialized, bwd, ctx.warm, ctx.use_triton, True
        )
        dx, dw = fp8_grads(ctx, dy8, dy8_t, g_scale.reciprocal(), x8_t, w8_t, x_inv, w_inv)
        return dx, dw, torch.cat((xw_amax, cur.view(1))), None, None, None, None, None, None


def fp8_forward_only(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    history: torch.Tensor,
    initialized: torch.Tensor,
    warm: bool,
    use_scaled_mm: bool,
) -> torch.Tensor:
    """The FP8 forward GEMM without autograd (evaluation): the scales the training forward takes, but
    no transposed fp8 copies (only a backward reads them) and no amaxes to record. The casts are torch
    ops, which Inductor fuses into the producer of ``x`` in the compiled layers."""
    fwd = recipe.fwd_dtype

    def scale(t: torch.Tensor, row: int) -> torch.Tensor:
        if recipe.recipe == "tensorwise":
            return scale_from_amax(current_amax(t), fwd)  # as _Fp8Matmul's forward
        past = history_amax(history[row], recipe.amax_compute_algo)  # as cast_delayed
        return (
            delayed_scale(past, None, None, fwd)
            if warm
            else delayed_scale(past, initialized[row], current_amax(t), fwd)
        )

    x_scale, w_scale = scale(x, X), scale(weight, W)
    return scaled_mm(
        quantize(x, x_scale, fwd).contiguous(),
        quantize(weight, w_scale, fwd).t(),
        x_scale.reciprocal(),
        w_scale.reciprocal(),
        x.dtype,
        use_scaled_mm,
        fast_accum=True,
    )
