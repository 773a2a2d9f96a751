"""fc1 -> SwiGLU -> fc2 of one MLP as one FP8 block with delayed scaling: SwiGLU's output is
quantised (fp8, transposed copy, amax) in the pass that computes it, and so is SwiGLU's gradient in
backward, so neither bf16 tensor is written and read again (docs/performance.md, "The SwiGLU MLP as
one FP8 block")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron.core.fusions.fp8.module import Fp8Gemm
from megatron.core.fusions.fp8.recipe import ALIGN, DY, Fp8Recipe, W, X
from megatron.core.fusions.fp8.scaling import delayed_scale, history_amax, scaled_mm
from megatron.core.fusions.swiglu import swiglu_torch
from megatron.core.fusions.triton import NO_KERNELS, TritonKernels
from megatron.core.fusions.triton.fp8_cast import fp8_cast_transpose_amax
from megatron.core.fusions.triton.swiglu_fp8 import (
    swiglu_backward_cast_transpose_amax,
    swiglu_cast_transpose_amax,
)


class _Fp8SwigluMlpDelayed(torch.autograd.Function):
    """The numerics of two :class:`Fp8MatmulDelayed` (warm histories) with SwiGLU between them, but
    SwiGLU's output and gradient are quantised inside SwiGLU's own passes.

    Local GEMMs only (the tensor-parallel collectives stay around it, in the MLP); ``x [M, K]``,
    ``w1 [2F, K]`` ([gate; up]), ``w2 [K', F]``; the amaxes ``[x, w, dy]`` of each linear leave as the
    gradient of its ``amax_sink``, as in :class:`Fp8MatmulDelayed`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        sink1: torch.Tensor,
        sink2: torch.Tensor,
        hist1: torch.Tensor,
        hist2: torch.Tensor,
        recipe: Fp8Recipe,
        use_scaled_mm: bool,
        casts: tuple[bool, bool],
    ) -> torch.Tensor:
        fwd, algo = recipe.fwd_dtype, recipe.amax_compute_algo
        cast, fused = casts  # Triton for the linears' casts (fp8_cast) and for the fused ones (swiglu_fp8)

        def scale(history: torch.Tensor, row: int) -> torch.Tensor:
            return delayed_scale(history_amax(history[row], algo), None, None, fwd)

        x_scale, w1_scale, a_scale, w2_scale = (
            scale(hist1, X),
            scale(hist1, W),
            scale(hist2, X),
            scale(hist2, W),
        )
        x8, x8_t, x_amax = fp8_cast_transpose_amax(x, x_scale, fwd, cast)
        w1_8, w1_8_t, w1_amax = fp8_cast_transpose_amax(w1, w1_scale, fwd, cast)
        x_inv, w1_inv, a_inv, w2_inv = (s.reciprocal() for s in (x_scale, w1_scale, a_scale, w2_scale))
        h = scaled_mm(x8, w1_8.t(), x_inv, w1_inv, x.dtype, use_scaled_mm, fast_accum=True)  # [M, 2F]
        a8, a8_t, a_amax = swiglu_cast_transpose_amax(h, a_scale, fwd, fused)
        w2_8, w2_8_t, w2_amax = fp8_cast_transpose_amax(w2, w2_scale, fwd, cast)
        out = scaled_mm(a8, w2_8.t(), a_inv, w2_inv, x.dtype, use_scaled_mm, fast_accum=True)
        dy_pasts = [history_amax(hist[DY], algo).clone() for hist in (hist1, hist2)]
        ctx.save_for_backward(
            x8_t,
            w1_8_t,
            h,
            a8_t,
            w2_8_t,
            x_inv,
            w1_inv,
            a_inv,
            w2_inv,
            *dy_pasts,
            torch.stack((x_amax, w1_amax, a_amax, w2_amax)),
        )
        ctx.recipe, ctx.use_scaled_mm, ctx.dtypes = recipe, use_scaled_mm, (x.dtype, w1.dtype, w2.dtype)
        ctx.casts = casts
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8_t, w1_8_t, h, a8_t, w2_8_t, x_inv, w1_inv, a_inv, w2_inv, dh_past, dy_past, amaxes = (
            ctx.saved_tensors
        )
        bwd, use = ctx.recipe.bwd_dtype, ctx.use_scaled_mm
        cast, fused = ctx.casts
        needs = ctx.needs_input_grad
        g2_scale = delayed_scale(dy_past, None, None, bwd)
        dy8, dy8_t, dy_amax = fp8_cast_transpose_amax(grad_out.contiguous(), g2_scale, bwd, cast)
        g2_inv = g2_scale.reciprocal()
        da = scaled_mm(
            dy8, w2_8_t.t(), g2_inv, w2_inv, ctx.dtypes[0], use
        )  # [M, F], SwiGLU's output gradient
        dw2 = scaled_mm(dy8_t, a8_t.t(), g2_inv, a_inv, ctx.dtypes[2], use) if needs[2] else None
        g1_scale = delayed_scale(dh_past, None, None, bwd)
        dh8, dh8_t, dh_amax = swiglu_backward_cast_transpose_amax(
            da, h, g1_scale, bwd, fused
        )  # fc1's output grad
        g1_inv = g1_scale.reciprocal()
        dx = scaled_mm(dh8, w1_8_t.t(), g1_inv, w1_inv, ctx.dtypes[0], use) if needs[0] else None
        dw1 = scaled_mm(dh8_t, x8_t.t(), g1_inv, x_inv, ctx.dtypes[1], use) if needs[1] else None
        sink1 = torch.stack((amaxes[0], amaxes[1], dh_amax))
        sink2 = torch.stack((amaxes[2], amaxes[3], dy_amax))
        return dx, dw1, dw2, sink1, sink2, None, None, None, None, None


class Fp8SwigluMlp:
    """The FP8 path of one SwiGLU MLP as one block (:class:`_Fp8SwigluMlpDelayed`); it uses, and
    updates, the two linears' own :class:`Fp8Gemm` state, so checkpoints and the amax reduction see
    no difference. A plain object, not a module: the state lives in the linears.

    It runs where it gives the two linears' numerics exactly: training (grad enabled) once both
    histories are warm; before that, and in evaluation, the MLP takes the two linears' own path.

    Args:
        fc1, fc2: the two linears' FP8 GEMMs (delayed scaling).
        activation: the MLP's SwiGLU, for the linears' path when the token count is not a multiple
            of 16 (default :func:`swiglu_torch`).
        kernels: the run's Triton kernels: ``swiglu_fp8`` for the fused casts (the linears' own
            casts follow ``fc1``'s kernels, ``fp8_cast``).
    """

    def __init__(
        self,
        fc1: Fp8Gemm,
        fc2: Fp8Gemm,
        *,
        activation: Callable[[torch.Tensor], torch.Tensor] = swiglu_torch,
        kernels: TritonKernels = NO_KERNELS,
    ) -> None:
        self.fc1, self.fc2 = fc1, fc2
        self.activation = activation
        self.kernels = kernels
        self.use_triton = kernels.uses("swiglu_fp8")

    def ready(self) -> bool:
        """Whether the next forward takes the block (training, both histories warm)."""
        return torch.is_grad_enabled() and self.fc1.warm and self.fc2.warm

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """``[..., K] -> [..., K']`` (fc1's input after its collective; fc2's output before its own)."""
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] % ALIGN != 0:  # the linears' own path, which falls back to bf16 and says so
            out: torch.Tensor = self.fc2(self.activation(self.fc1(x, w1, None)), w2, None)
            return out
        fc1, fc2 = self.fc1, self.fc2
        out = _Fp8SwigluMlpDelayed.apply(
            x2d,
            w1,
            w2,
            fc1.amax_sink,
            fc2.amax_sink,
            fc1.amax_history,
            fc2.amax_history,
            fc1.recipe,
            fc1.use_scaled_mm,
            (fc1.use_triton, self.use_triton),
        )
        return out.view(*x.shape[:-1], w2.shape[0])
