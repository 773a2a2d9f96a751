"""The eager reference of delayed FP8 scaling, for tests: every call reads its scale from the amax
history and pushes its own amax into it inside forward and backward (the library's Fp8Gemm records
the amaxes after the backward instead, so that it compiles; the tests compare the two). Built on the
library's one definition of the scale and history rule (megatron/core/fusions/fp8/scaling.py)."""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.fusions.fp8.gemm import fp8_grads
from megatron.core.fusions.fp8.recipe import DY, Fp8Recipe, W, X
from megatron.core.fusions.fp8.scaling import (
    current_amax,
    delayed_scale,
    history_amax,
    scale_from_amax,
    scaled_mm,
)
from megatron.core.fusions.triton.fp8_cast import fp8_amax, fp8_cast_transpose


def push(history: torch.Tensor, initialized: torch.Tensor, row: int, amax: torch.Tensor) -> None:
    """Record ``amax`` as the most recent entry of ``history[row]`` (the oldest falls out)."""
    history[row].copy_(torch.roll(history[row], 1))
    history[row, 0] = amax
    initialized[row].fill_(True)


def tensor_scale(
    t: torch.Tensor,
    dtype: torch.dtype,
    recipe: Fp8Recipe,
    history: torch.Tensor | None,
    initialized: torch.Tensor | None,
    row: int,
) -> torch.Tensor:
    """The quantisation scale of ``t``; with delayed scaling also pushes its amax into ``history[row]``."""
    cur = current_amax(t)
    if recipe.recipe == "tensorwise" or history is None or initialized is None:
        return scale_from_amax(cur, dtype)
    scale = delayed_scale(history_amax(history[row], recipe.amax_compute_algo), initialized[row], cur, dtype)
    push(history, initialized, row, cur)
    return scale


class _ReferenceMatmul(torch.autograd.Function):
    """``Y = X W^T`` in FP8, the history updated inside forward (X, W) and backward (dY)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        recipe: Fp8Recipe,
        history: torch.Tensor | None,
        initialized: torch.Tensor | None,
        use_scaled_mm: bool,
    ) -> torch.Tensor:
        fwd = recipe.fwd_dtype
        x_scale = tensor_scale(x, fwd, recipe, history, initialized, X)
        w_scale = tensor_scale(weight, fwd, recipe, history, initialized, W)
        x8, x8_t = fp8_cast_transpose(x, x_scale, fwd, False)
        w8, w8_t = fp8_cast_transpose(weight, w_scale, fwd, False)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, use_scaled_mm, fast_accum=True)
        ctx.save_for_backward(x8_t, w8_t, x_inv, w_inv)
        ctx.recipe, ctx.history, ctx.initialized, ctx.use_scaled_mm = (
            recipe,
            history,
            initialized,
            use_scaled_mm,
        )
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8_t, w8_t, x_inv, w_inv = ctx.saved_tensors
        bwd = ctx.recipe.bwd_dtype
        dy = grad_out.contiguous()
        if ctx.history is None:
            g_scale = scale_from_amax(fp8_amax(dy, False), bwd)
        else:
            g_scale = tensor_scale(dy, bwd, ctx.recipe, ctx.history, ctx.initialized, DY)
        dy8, dy8_t = fp8_cast_transpose(dy, g_scale, bwd, False)
        return (
            *fp8_grads(ctx, dy8, dy8_t, g_scale.reciprocal(), x8_t, w8_t, x_inv, w_inv),
            None,
            None,
            None,
            None,
        )


def fp8_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    history: torch.Tensor | None = None,
    initialized: torch.Tensor | None = None,
    use_scaled_mm: bool = True,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` in FP8; with ``history``, delayed scaling updates it eagerly."""
    out: torch.Tensor = _ReferenceMatmul.apply(x, weight, recipe, history, initialized, use_scaled_mm)
    return out
