"""FP8 GEMMs for the tensor-parallel linears (QKV, proj, fc1, fc2) on Hopper, with ``torch._scaled_mm``.

FP8 is compute only: weights, their gradients and the optimizer stay in bf16 / fp32, checkpoints are
unchanged. For ``Y = X W^T`` the forward quantises ``X`` and ``W`` to e4m3 with one fp32 scale per
tensor; the backward quantises ``dY`` (e5m2 for ``hybrid``, e4m3 for ``e4m3``, as Transformer Engine
and Megatron define the formats) and computes ``dX = dY W`` and ``dW = dY^T X`` in FP8 as well.

Scaling recipes (``scale = fp8_max / amax``, so the largest value maps to the top of the format):
  * ``tensorwise``: amax of the tensor being quantised (exact, one reduction per tensor, no state);
  * ``delayed``: amax from a per-tensor history of the previous calls (``max`` over it or the
    ``most_recent`` entry); the current amax is then pushed into the history (in the layers, once
    the call's backward has run; see :class:`Fp8Gemm`). The first call uses the current amax.
    Values above the delayed scale saturate at fp8_max.

The numerics are one code path for every device: quantise -> :func:`scaled_mm`. The linears quantise
with ``fp8_cast_transpose`` (triton_kernels.py: the fp8 copy and its transpose in one pass, the
layouts the three GEMMs read; a Triton kernel on CUDA, bit-identical to :func:`quantize` elsewhere).
:func:`scaled_mm` calls ``torch._scaled_mm`` (first operand row-major, second column-major, every dim
a multiple of 16, bf16 output) or, with ``use_scaled_mm=False``, multiplies the dequantised fp8 values
in fp32 — the reference the tests compare it against.

With delayed scaling a SwiGLU MLP without biases runs fc1 -> SwiGLU -> fc2 as one block
(:class:`Fp8SwigluMlp`) that quantises SwiGLU's output and gradient inside SwiGLU's own passes.

``--fp8-gemm-impl torchao`` hands the tensorwise recipe's GEMMs to torchao's float8 training
(``matmul_with_hp_or_float8_args``, the function behind its ``Float8Linear``): the same quantisation,
torchao's choices of what to save for backward and of fast accumulation in the forward GEMM. It is
there to choose the faster implementation by measurement (docs/performance.md); torchao is optional.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.fusions.triton_kernels import (
    fp8_amax,
    fp8_cast_transpose,
    fp8_cast_transpose_amax,
    prepare_kernels,
    swiglu_backward_cast_transpose_amax,
    swiglu_cast_transpose_amax,
)

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")
GEMM_IMPLS = ("scaled_mm", "torchao")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The linears that run in FP8 (Megatron: the transformer layers' GEMMs, never the output layer).
FP8_LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALIGN = 16  # torch._scaled_mm: every GEMM dim a multiple of 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
X, W, DY = 0, 1, 2  # rows of the amax history


@dataclass(frozen=True)
class Fp8Recipe:
    """How one run quantises: ``format`` in FORMATS, ``recipe`` in RECIPES, delayed scaling's history,
    and who runs the GEMMs (``gemm_impl`` in GEMM_IMPLS)."""

    format: str = "hybrid"
    recipe: str = "delayed"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    gemm_impl: str = "scaled_mm"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    @classmethod
    def from_config(cls, config) -> Fp8Recipe | None:
        """The recipe of a ``TransformerConfig`` (None when ``--fp8-format`` is not given)."""
        if not getattr(config, "fp8_format", None):
            return None
        return cls(config.fp8_format, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
                   getattr(config, "fp8_gemm_impl", "scaled_mm"))

    def describe(self) -> str:
        grads = "e5m2" if self.format == "hybrid" else "e4m3"
        scaling = ("tensorwise scaling (current amax)" if self.recipe == "tensorwise" else
                   f"delayed scaling (amax history {self.amax_history_len}, {self.amax_compute_algo})")
        return f"{self.format} (e4m3 forward, {grads} gradients), {scaling}"

    @property
    def gemm_name(self) -> str:
        return "torchao float8 training" if self.gemm_impl == "torchao" else "torch._scaled_mm"


def torchao_error() -> str | None:
    """Why ``--fp8-gemm-impl torchao`` cannot run here (None when torchao's float8 training imports)."""
    try:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as exc:
        return (f"--fp8-gemm-impl torchao needs torchao's float8 training ({exc}); pip install torchao, or use "
                "--fp8-gemm-impl scaled_mm (the default)")
    return None


def _torchao_matmul(recipe: Fp8Recipe, emulate: bool):
    """``(x2d, weight) -> x2d @ weight.T`` through torchao's float8 training, tensorwise scaling, with
    ``recipe``'s formats (``emulate``: dequantised fp32 GEMMs, for devices without FP8)."""
    import dataclasses

    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    grads = {f: dataclasses.replace(getattr(config, f), target_dtype=recipe.bwd_dtype)
             for f in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")}
    config = dataclasses.replace(config, emulate=emulate, **grads)
    mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim)
                          for g in (config.gemm_config_output, config.gemm_config_grad_input,
                                    config.gemm_config_grad_weight)))
    return lambda x2d, weight: matmul_with_hp_or_float8_args.apply(x2d, weight.t(), mm, config)


# ------------------------------------------------------------------------------------------------
# Quantisation and the scaled GEMM: the exact numerics of every device.

def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 quantisation scale ``fp8_max / amax``; 1 where amax is 0 or not finite."""
    amax = amax.float()
    scale = torch.finfo(dtype).max / amax.clamp(min=1e-12)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(scale))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` saturated to the format's range and cast to ``dtype`` (computed in fp32)."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
              out_dtype: torch.dtype, use_scaled_mm: bool = True, fast_accum: bool = False) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for fp8 ``a [M, K]`` (row-major) and ``b [K, N]`` (column-major).

    ``a_inv`` / ``b_inv`` are the fp32 dequantisation scales (1 / quantisation scale). ``fast_accum``:
    Hopper's FP8 tensor cores accumulate in their own reduced-precision accumulator without
    promoting partial sums to fp32 every few K-blocks; faster, and what Transformer Engine and torchao
    use for the forward GEMM (the gradients' GEMMs promote). The reference path ignores it.
    """
    if use_scaled_mm:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


def _delayed_scale(past: torch.Tensor, initialized: torch.Tensor, cur: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Delayed scaling's scale: from ``past``, the amax read from the history (:func:`_history_amax`),
    or from the current amax ``cur`` before the first entry (``initialized`` False)."""
    return scale_from_amax(torch.where(initialized, past, cur), dtype)


def _cast_delayed(t: torch.Tensor, past: torch.Tensor, initialized: torch.Tensor, dtype: torch.dtype, warm: bool,
                  amax_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t8, t8 transposed, amax of t, scale)`` with delayed scaling, ``past`` being the amax read
    from the history (:func:`_history_amax`). ``warm`` (known on the host: the history has entries)
    takes the scale from it alone, so the cast, the transpose and the amax are one pass over ``t``;
    before that the scale may be the current amax, computed first by ``amax_of(t)``."""
    if warm:
        scale = scale_from_amax(past, dtype)
        t8, t8_t, amax = fp8_cast_transpose_amax(t, scale, dtype)
    else:
        amax = amax_of(t)
        scale = _delayed_scale(past, initialized, amax, dtype)
        t8, t8_t = fp8_cast_transpose(t, scale, dtype)
    return t8, t8_t, amax, scale


def _torch_amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` in fp32 by the torch ops (inside compiled layers Inductor fuses it with t's producer)."""
    return t.detach().abs().amax().float()


def _history_amax(row: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax delayed scaling reads from one history row: its max or its most recent entry."""
    return row.amax() if algo == "max" else row[0]


def _fp8_grads(ctx, dy8: torch.Tensor, dy8_t: torch.Tensor, g_inv: torch.Tensor, x8_t: torch.Tensor,
               w8_t: torch.Tensor, x_inv: torch.Tensor,
               w_inv: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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


def _push(history: torch.Tensor, initialized: torch.Tensor, row: int, amax: torch.Tensor) -> None:
    """Record ``amax`` as the most recent entry of ``history[row]`` (the oldest falls out)."""
    history[row].copy_(torch.roll(history[row], 1))
    history[row, 0] = amax
    initialized[row].fill_(True)  # not ``= True``: on a GPU that copies a host tensor and waits for the stream


def _push_rows(history: torch.Tensor, initialized: torch.Tensor, amaxes: torch.Tensor) -> None:
    """:func:`_push` of ``amaxes[r]`` into every row ``r`` at once (two kernels, no host sync)."""
    history.copy_(torch.cat((amaxes.reshape(-1, 1).to(history.dtype), history[:, :-1]), dim=1))
    initialized.fill_(True)


def tensor_scale(t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, history: torch.Tensor | None,
                 initialized: torch.Tensor | None, row: int) -> torch.Tensor:
    """The quantisation scale of ``t``; with delayed scaling also pushes its amax into ``history[row]``.

    No host synchronisation: the history update and the first-call choice are device ops.
    """
    cur = _torch_amax(t)
    if recipe.recipe == "tensorwise" or history is None or initialized is None:
        return scale_from_amax(cur, dtype)
    scale = _delayed_scale(_history_amax(history[row], recipe.amax_compute_algo), initialized[row], cur, dtype)
    _push(history, initialized, row, cur)
    return scale


class _Fp8Matmul(torch.autograd.Function):
    """``Y [M, N] = X [M, K] W[N, K]^T`` in FP8.

    Forward: X, W -> e4m3 with per-tensor scales; ``Y = _scaled_mm(X8, W8^T)`` in X's dtype.
    Backward: dY -> the gradient format; ``dX = dY8 W8`` and ``dW = dY8^T X8`` (the saved fp8 copies
    of W and of X transposed, written by the forward's cast-transpose: X is kept at one byte per
    element, in the layout the weight-gradient GEMM reads).
    """

    @staticmethod
    def forward(ctx, x, weight, recipe, history, initialized, use_scaled_mm):  # type: ignore[override]
        fwd = recipe.fwd_dtype
        x_scale = tensor_scale(x, fwd, recipe, history, initialized, X)
        w_scale = tensor_scale(weight, fwd, recipe, history, initialized, W)
        x8, x8_t = fp8_cast_transpose(x, x_scale, fwd)  # [M, K] and [K, M]
        w8, w8_t = fp8_cast_transpose(weight, w_scale, fwd)  # [N, K] and [K, N]
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, use_scaled_mm, fast_accum=True)  # [M, N]
        ctx.save_for_backward(x8_t, w8_t, x_inv, w_inv)
        ctx.recipe, ctx.history, ctx.initialized, ctx.use_scaled_mm = recipe, history, initialized, use_scaled_mm
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x8_t, w8_t, x_inv, w_inv = ctx.saved_tensors
        bwd = ctx.recipe.bwd_dtype
        dy = grad_out.contiguous()  # [M, N]
        if ctx.history is None:  # tensorwise: the amax pass, then the cast-transpose pass
            g_scale = scale_from_amax(fp8_amax(dy), bwd)
        else:
            g_scale = tensor_scale(dy, bwd, ctx.recipe, ctx.history, ctx.initialized, DY)
        dy8, dy8_t = fp8_cast_transpose(dy, g_scale, bwd)
        return (*_fp8_grads(ctx, dy8, dy8_t, g_scale.reciprocal(), x8_t, w8_t, x_inv, w_inv), None, None, None, None)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, history: torch.Tensor | None = None,
               initialized: torch.Tensor | None = None, use_scaled_mm: bool = True) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` in FP8 (see :class:`_Fp8Matmul`); M, N, K multiples of 16.

    With ``history``, delayed scaling updates it inside forward and backward (eager code; the layers
    use :class:`Fp8Gemm`, whose delayed path compiles)."""
    return _Fp8Matmul.apply(x, weight, recipe, history, initialized, use_scaled_mm)


class _Fp8MatmulDelayed(torch.autograd.Function):
    """Delayed scaling with the numerics of :class:`_Fp8Matmul` with a history, but nothing is written
    inside it, so that it compiles into the layers' graphs (the eager version broke each layer's graph
    at every FP8 linear and quantised with unfused eager kernels) and an activation-recompute replay
    of the forward computes exactly what the original forward did:

    * forward: the scales of ``x`` and ``w`` come from the history (read only; the current amax
      before the first entry); their current amaxes are saved;
    * backward: the gradient's scale likewise from the history values read in forward; the three
      current amaxes ``[x, w, dy]`` leave as the gradient of ``amax_sink``, a leaf tensor whose
      post-accumulate hook (:class:`Fp8Gemm`) records them, outside any graph.

    So a forward's amaxes enter the history when its backward has run (the next forward sees them,
    as in eager delayed scaling); a forward without backward (evaluation) records nothing.

    ``warm`` (a host bool: the history has entries) drops the device-side choice between history and
    current amax, the same values from then on: no cast waits for its tensor's amax reduction, and
    each tensor's cast, transpose and amax are one pass (:func:`fp8_cast_transpose_amax`). A compiled layer
    recompiles once, when it turns True.
    """

    @staticmethod
    def forward(ctx, x, weight, amax_sink, history, initialized, recipe, use_scaled_mm, warm):  # type: ignore[override]
        fwd, algo = recipe.fwd_dtype, recipe.amax_compute_algo
        x8, x8_t, x_amax, x_scale = _cast_delayed(x, _history_amax(history[X], algo), initialized[X], fwd, warm,
                                                  _torch_amax)
        w8, w8_t, w_amax, w_scale = _cast_delayed(weight, _history_amax(history[W], algo), initialized[W], fwd,
                                                  warm, _torch_amax)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype, use_scaled_mm, fast_accum=True)
        dy_past = _history_amax(history[DY], algo)
        ctx.save_for_backward(x8_t, w8_t, x_inv, w_inv, dy_past.clone(), initialized[DY].clone(),
                              torch.stack((x_amax, w_amax)))
        ctx.recipe, ctx.use_scaled_mm, ctx.dtypes, ctx.warm = recipe, use_scaled_mm, (x.dtype, weight.dtype), warm
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x8_t, w8_t, x_inv, w_inv, dy_past, dy_initialized, xw_amax = ctx.saved_tensors
        bwd = ctx.recipe.bwd_dtype
        # the gradient's amax, where the history is not yet warm, by the Triton reduction (dY comes from
        # opaque kernels such as the SwiGLU backward, so Inductor has no producer to fuse it with)
        dy8, dy8_t, cur, g_scale = _cast_delayed(grad_out.contiguous(), dy_past, dy_initialized, bwd, ctx.warm,
                                                 fp8_amax)
        dx, dw = _fp8_grads(ctx, dy8, dy8_t, g_scale.reciprocal(), x8_t, w8_t, x_inv, w_inv)
        return dx, dw, torch.cat((xw_amax, cur.view(1))), None, None, None, None, None


class _Fp8SwigluMlpDelayed(torch.autograd.Function):
    """fc1 -> SwiGLU -> fc2 of one MLP in FP8 with delayed scaling and warm histories: the numerics of
    two :class:`_Fp8MatmulDelayed` with SwiGLU between them, but SwiGLU's output is quantised (fp8,
    transposed copy, amax) in the pass that computes it, and so is SwiGLU's gradient in backward, so
    neither bf16 tensor is written and read again (llama-3b: [8192, 8192] and [8192, 16384] a layer;
    at the GPU's power cap those two casts cost ~9 ms of a 240 ms FP8 step, docs/performance.md).

    Local GEMMs only (the tensor-parallel collectives stay around it, in the MLP); ``x [M, K]``,
    ``w1 [2F, K]`` ([gate; up]), ``w2 [K', F]``; the amaxes ``[x, w, dy]`` of each linear leave as the
    gradient of its ``amax_sink``, as in :class:`_Fp8MatmulDelayed`.
    """

    @staticmethod
    def forward(ctx, x, w1, w2, sink1, sink2, hist1, hist2, recipe, use_scaled_mm):  # type: ignore[override]
        fwd, algo = recipe.fwd_dtype, recipe.amax_compute_algo

        def scale(history: torch.Tensor, row: int) -> torch.Tensor:
            return scale_from_amax(_history_amax(history[row], algo), fwd)

        x_scale, w1_scale, a_scale, w2_scale = scale(hist1, X), scale(hist1, W), scale(hist2, X), scale(hist2, W)
        x8, x8_t, x_amax = fp8_cast_transpose_amax(x, x_scale, fwd)
        w1_8, w1_8_t, w1_amax = fp8_cast_transpose_amax(w1, w1_scale, fwd)
        x_inv, w1_inv, a_inv, w2_inv = (s.reciprocal() for s in (x_scale, w1_scale, a_scale, w2_scale))
        h = scaled_mm(x8, w1_8.t(), x_inv, w1_inv, x.dtype, use_scaled_mm, fast_accum=True)  # [M, 2F]
        a8, a8_t, a_amax = swiglu_cast_transpose_amax(h, a_scale, fwd)
        w2_8, w2_8_t, w2_amax = fp8_cast_transpose_amax(w2, w2_scale, fwd)
        out = scaled_mm(a8, w2_8.t(), a_inv, w2_inv, x.dtype, use_scaled_mm, fast_accum=True)
        dy_pasts = [_history_amax(hist[DY], algo).clone() for hist in (hist1, hist2)]
        ctx.save_for_backward(x8_t, w1_8_t, h, a8_t, w2_8_t, x_inv, w1_inv, a_inv, w2_inv, *dy_pasts,
                              torch.stack((x_amax, w1_amax, a_amax, w2_amax)))
        ctx.recipe, ctx.use_scaled_mm, ctx.dtypes = recipe, use_scaled_mm, (x.dtype, w1.dtype, w2.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x8_t, w1_8_t, h, a8_t, w2_8_t, x_inv, w1_inv, a_inv, w2_inv, dh_past, dy_past, amaxes = ctx.saved_tensors
        bwd, use = ctx.recipe.bwd_dtype, ctx.use_scaled_mm
        needs = ctx.needs_input_grad
        g2_scale = scale_from_amax(dy_past, bwd)
        dy8, dy8_t, dy_amax = fp8_cast_transpose_amax(grad_out.contiguous(), g2_scale, bwd)
        g2_inv = g2_scale.reciprocal()
        da = scaled_mm(dy8, w2_8_t.t(), g2_inv, w2_inv, ctx.dtypes[0], use)  # [M, F], SwiGLU's output gradient
        dw2 = scaled_mm(dy8_t, a8_t.t(), g2_inv, a_inv, ctx.dtypes[2], use) if needs[2] else None
        g1_scale = scale_from_amax(dh_past, bwd)
        dh8, dh8_t, dh_amax = swiglu_backward_cast_transpose_amax(da, h, g1_scale, bwd)  # fc1's output gradient
        g1_inv = g1_scale.reciprocal()
        dx = scaled_mm(dh8, w1_8_t.t(), g1_inv, w1_inv, ctx.dtypes[0], use) if needs[0] else None
        dw1 = scaled_mm(dh8_t, x8_t.t(), g1_inv, x_inv, ctx.dtypes[1], use) if needs[1] else None
        sink1 = torch.stack((amaxes[0], amaxes[1], dh_amax))
        sink2 = torch.stack((amaxes[2], amaxes[3], dy_amax))
        return dx, dw1, dw2, sink1, sink2, None, None, None, None


class Fp8SwigluMlp:
    """The FP8 path of one SwiGLU MLP as one block (:class:`_Fp8SwigluMlpDelayed`), held by the MLP
    as ``fp8_swiglu`` (set by :func:`apply_fp8`); it uses, and updates, the two linears' own
    :class:`Fp8Gemm` state, so checkpoints and the amax reduction see no difference.

    It runs where it gives the two linears' numerics exactly: training (grad enabled) once both
    histories are warm; before that, and in evaluation, the MLP takes the two linears' own path.
    A plain object, not a module: the state lives in the linears."""

    def __init__(self, fc1: Fp8Gemm, fc2: Fp8Gemm):
        self.fc1, self.fc2 = fc1, fc2

    def ready(self) -> bool:
        """Whether the next forward takes the block (training, both histories warm)."""
        return torch.is_grad_enabled() and self.fc1.warm and self.fc2.warm

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """``[..., K] -> [..., K']`` (fc1's input after its collective; fc2's output before its own)."""
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] % ALIGN != 0:  # the linears' own path, which falls back to bf16 and says so
            from megatron.core.transformer.mlp import swiglu

            return self.fc2(swiglu(self.fc1(x, w1, None)), w2, None)
        fc1, fc2 = self.fc1, self.fc2
        out = _Fp8SwigluMlpDelayed.apply(x2d, w1, w2, fc1.amax_sink, fc2.amax_sink, fc1.amax_history,
                                         fc2.amax_history, fc1.recipe, fc1.use_scaled_mm)
        return out.view(*x.shape[:-1], w2.shape[0])


class _AmaxReduction:
    """Delayed scaling across ranks: the amaxes of every FP8 GEMM a backward pass went through are
    reduced (max) over their group in one all-reduce when that backward ends, then enter the
    histories (one small collective per backward instead of one per linear: 104 on llama-3b). The
    histories still advance before the next forward reads them, so every scale is the one a
    reduction per linear gives; nothing in the same backward reads a history that moved."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[Any, list[tuple[Fp8Gemm, torch.Tensor]]]] = {}  # id(group) -> entries
        self.task = -2  # the autograd graph task whose end runs flush (-2: none queued)

    def add(self, gemm: Fp8Gemm, amaxes: torch.Tensor) -> None:
        self.pending.setdefault(id(gemm.amax_group), (gemm.amax_group, []))[1].append((gemm, amaxes))
        task = torch._C._current_graph_task_id()
        if task != self.task:  # first GEMM of this backward (or one that failed before its end)
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    @torch.no_grad()
    def flush(self) -> None:
        pending, self.pending, self.task = self.pending, {}, -2
        for group, entries in pending.values():
            stacked = torch.stack([amaxes for _, amaxes in entries])
            torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX, group=group)
            for (gemm, _), row in zip(entries, stacked):
                gemm.push_amaxes(row)


def _fp8_forward_only(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, history: torch.Tensor,
                      initialized: torch.Tensor, warm: bool, use_scaled_mm: bool) -> torch.Tensor:
    """The FP8 forward GEMM without autograd (evaluation): the scales the training forward takes, but
    no transposed fp8 copies (only a backward reads them) and no amaxes to record. The casts are torch
    ops, which Inductor fuses into the producer of ``x`` in the compiled layers."""
    fwd = recipe.fwd_dtype

    def scale(t: torch.Tensor, row: int) -> torch.Tensor:
        if recipe.recipe == "tensorwise":
            return tensor_scale(t, fwd, recipe, None, None, row)  # as _Fp8Matmul's forward
        past = _history_amax(history[row], recipe.amax_compute_algo)  # as _cast_delayed
        return scale_from_amax(past, fwd) if warm else _delayed_scale(past, initialized[row], _torch_amax(t), fwd)

    x_scale, w_scale = scale(x, X), scale(weight, W)
    return scaled_mm(quantize(x, x_scale, fwd).contiguous(), quantize(weight, w_scale, fwd).t(), x_scale.reciprocal(),
                     w_scale.reciprocal(), x.dtype, use_scaled_mm, fast_accum=True)


class Fp8Gemm(nn.Module):
    """The FP8 compute of one linear (held as its ``fp8`` submodule): scaling state, no weights.

    The amax history is a non-persistent buffer (``[3, L]`` rows X, W, dY): the model's state dict
    does not change; checkpoints hold it apart (:func:`fp8_sharded_state_dict`). With delayed scaling the amaxes of
    a forward/backward arrive as the gradient of ``amax_sink`` (see :class:`_Fp8MatmulDelayed`), a
    plain ``[3]`` tensor (not a parameter: no optimizer, no data-parallel reduction sees it).
    """

    amax_history: torch.Tensor
    initialized: torch.Tensor

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str | None = None, use_scaled_mm: bool = True):
        super().__init__()
        self.recipe = recipe
        self.use_scaled_mm = use_scaled_mm
        length = recipe.amax_history_len if recipe.recipe == "delayed" else 1
        self.register_buffer("amax_history", torch.zeros(3, length, device=device), persistent=False)
        self.register_buffer("initialized", torch.zeros(3, dtype=torch.bool, device=device), persistent=False)
        self.amax_sink: torch.Tensor | None = None
        self.warm = False  # delayed scaling: the history has entries (set by the hook; see _Fp8MatmulDelayed)
        # delayed scaling: the ranks whose amaxes are reduced (max) before they enter the history, so that
        # every rank of a tensor-parallel shard set, and of the data-parallel replicas, uses the same scales
        self.amax_group: object | None = None
        if recipe.recipe == "delayed":
            self._make_sink(self.amax_history.device)
        self._torchao = _torchao_matmul(recipe, emulate=not use_scaled_mm) if recipe.gemm_impl == "torchao" else None

    def _make_sink(self, device: torch.device) -> None:
        self.amax_sink = torch.zeros(3, device=device, requires_grad=True)
        self.amax_sink.register_post_accumulate_grad_hook(self._record_amaxes)

    @torch.no_grad()
    def _record_amaxes(self, sink: torch.Tensor) -> None:
        """After each backward through this GEMM: its forward's x / w amaxes and the gradient's amax
        (with an ``amax_group``, reduced together with the other GEMMs' when the backward ends)."""
        if sink.grad is not None:
            if self.amax_group is not None:
                _AMAX_REDUCTION.add(self, sink.grad)
            else:
                self.push_amaxes(sink.grad)
            sink.grad = None

    @torch.no_grad()
    def push_amaxes(self, amaxes: torch.Tensor) -> None:
        """``amaxes`` ([x, w, dY]) into the history."""
        _push_rows(self.amax_history, self.initialized, amaxes)
        self.warm = True

    def _apply(self, fn, recurse=True):  # .to() / .cuda(): the sink follows the buffers
        out = super()._apply(fn, recurse)
        if self.amax_sink is not None and self.amax_sink.device != self.amax_history.device:
            self._make_sink(self.amax_history.device)
        return out

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[..., K] -> [..., N]``; falls back to ``F.linear`` when the token count is not a multiple of 16."""
        x2d = x.reshape(-1, x.shape[-1])  # [M, K]
        if x2d.shape[0] % ALIGN != 0:
            warnings.warn(f"FP8: {x2d.shape[0]} tokens per GEMM is not a multiple of {ALIGN}; "
                          "those GEMMs run in bf16 (use a micro-batch x sequence length divisible by 16)",
                          stacklevel=2)
            return F.linear(x, weight, bias)
        if self._torchao is not None:
            out = self._torchao(x2d, weight)
        elif not torch.is_grad_enabled():
            out = _fp8_forward_only(x2d, weight, self.recipe, self.amax_history, self.initialized, self.warm,
                                    self.use_scaled_mm)
        elif self.recipe.recipe == "delayed":
            out = _Fp8MatmulDelayed.apply(x2d, weight, self.amax_sink, self.amax_history, self.initialized,
                                          self.recipe, self.use_scaled_mm, self.warm)
        else:
            out = fp8_matmul(x2d, weight, self.recipe, None, None, self.use_scaled_mm)
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out + bias if bias is not None else out


_AMAX_REDUCTION = _AmaxReduction()


# ------------------------------------------------------------------------------------------------
# Start-up: which devices and layers can run it.

# Tests only: FP8 on the CPU, its GEMMs emulated in fp32 on the dequantised fp8 values (slow), so that
# the parallel layouts can be checked with FP8 through pretrain_gpt.py on gloo.
EMULATE_ENV = "MEGATRON_FP8_EMULATE"


def fp8_emulated(device: torch.device) -> bool:
    """FP8 runs emulated: a CPU run with ``MEGATRON_FP8_EMULATE=1`` (tests of the layouts)."""
    return torch.device(device).type == "cpu" and os.environ.get(EMULATE_ENV) == "1"


def fp8_device_error(device: torch.device) -> str | None:
    """Why ``device`` cannot run the FP8 GEMMs (None when it can: CUDA, compute capability 9.0+)."""
    device = torch.device(device)
    if fp8_emulated(device):
        return None
    if device.type != "cuda":
        return (f"--fp8-format needs an H100/H200-class GPU (Hopper, compute capability 9.0 or newer); this run "
                f"is on the {device.type.upper()}. Drop --fp8-format to train in bf16")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"--fp8-format needs an H100/H200-class GPU (Hopper, compute capability 9.0 or newer); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Drop --fp8-format to train in bf16")
    return None


def bf16_layer_numbers(config) -> set[int]:
    """The global 1-based numbers of the transformer layers that ``--first-last-layers-bf16`` keeps in bf16."""
    if not getattr(config, "first_last_layers_bf16", False):
        return set()
    n = config.num_layers
    return {i for i in range(1, n + 1)
            if i <= config.num_layers_at_start_in_bf16 or i > n - config.num_layers_at_end_in_bf16}


def _bf16_layer_linears(modules: list[nn.Module], config) -> set[int]:
    """``id`` of every module inside a transformer layer kept in bf16 (its global ``layer_number``)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    numbers = bf16_layer_numbers(config)
    return {id(m) for root in modules for layer in root.modules()
            if isinstance(layer, TransformerLayer) and layer.layer_number in numbers for m in layer.modules()}


def apply_fp8(modules: list[nn.Module], config, device: torch.device, amax_group=None) -> int:
    """Give every QKV / proj / fc1 / fc2 linear of ``modules`` an :class:`Fp8Gemm`; returns how many.

    ``amax_group``: with delayed scaling, the process group over which each amax is reduced (max)
    before it enters the history (Megatron's amax reduction group: the tensor-, context- and
    data-parallel ranks of this pipeline stage, or the tensor-parallel ones); None: this rank's own.

    Does nothing without ``config.fp8_format``. Raises ValueError (naming ``--fp8-format``) when the
    device cannot run FP8; linears whose weight dims are not multiples of 16 stay in bf16, with one
    warning naming them, as do those of the layers ``--first-last-layers-bf16`` keeps in bf16.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    recipe = Fp8Recipe.from_config(config)
    if recipe is None:
        return 0
    error = fp8_device_error(device)
    if error:
        raise ValueError(error)
    prepare_kernels(torch.device(device))  # self-check the cast kernels now, before any compile traces them
    emulated = fp8_emulated(device)
    if emulated:
        warnings.warn(f"FP8 emulated on the CPU ({EMULATE_ENV}=1): fp32 GEMMs on the dequantised fp8 values, "
                      "for tests only", stacklevel=2)
    count, skipped = 0, []
    in_bf16 = _bf16_layer_linears(modules, config)
    for root in modules:
        for name, module in root.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if name.rsplit(".", 1)[-1] not in FP8_LINEAR_NAMES or module.weight is None or id(module) in in_bf16:
                continue
            n, k = module.weight.shape
            if n % ALIGN or k % ALIGN:
                skipped.append(f"{name} [{n}, {k}]")
                continue
            module.fp8 = (Fp8Gemm(recipe, device=module.weight.device, use_scaled_mm=False) if emulated
                          else Fp8Gemm(recipe, device=module.weight.device))
            if recipe.recipe == "delayed":
                module.fp8.amax_group = amax_group
            count += 1
    _fuse_swiglu_mlps(modules, config)
    if skipped:
        warnings.warn(f"FP8: {len(skipped)} linears keep bf16 GEMMs because a weight dim is not a multiple of "
                      f"{ALIGN}: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}", stacklevel=2)
    return count


def swiglu_mlp_fusable(config) -> bool:
    """Whether :func:`apply_fp8` runs this model's SwiGLU MLPs as one FP8 block (:class:`Fp8SwigluMlp`):
    delayed scaling with our GEMMs, SwiGLU, no biases."""
    recipe = Fp8Recipe.from_config(config)
    return (recipe is not None and recipe.recipe == "delayed" and recipe.gemm_impl == "scaled_mm"
            and getattr(config, "activation", None) == "swiglu" and not getattr(config, "add_bias_linear", True))


def _fuse_swiglu_mlps(modules: list[nn.Module], config) -> None:
    """Where :func:`swiglu_mlp_fusable` allows it, give every SwiGLU MLP whose fc1 and fc2 both run in
    FP8 (not a layer ``--first-last-layers-bf16`` keeps in bf16; no bias, no output gather) an
    :class:`Fp8SwigluMlp`."""
    from megatron.core.transformer.mlp import MLP, swiglu

    if not swiglu_mlp_fusable(config):
        return
    for root in modules:
        for mlp in root.modules():
            if not isinstance(mlp, MLP) or mlp.activation is not swiglu:
                continue
            fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
            if (isinstance(fc1.fp8, Fp8Gemm) and isinstance(fc2.fp8, Fp8Gemm) and fc1.bias is None
                    and fc2.bias is None and not fc1.gather_output):
                mlp.fp8_swiglu = Fp8SwigluMlp(fc1.fp8, fc2.fp8)


# ------------------------------------------------------------------------------------------------
# Checkpoints: delayed scaling's amax histories, so that a resumed run scales as the uninterrupted one.

def _delayed_gemms(chunks: Sequence[nn.Module]):
    """``(chunk, local name, Fp8Gemm)`` for every delayed-scaling FP8 GEMM of ``chunks`` (GPT model
    chunks, maybe in a DistributedDataParallel wrapper)."""
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for name, module in chunk.named_modules():
            if isinstance(module, Fp8Gemm) and module.recipe.recipe == "delayed":
                yield chunk, name, module


def fp8_sharded_state_dict(chunks: Sequence[nn.Module], tp_rank: int, dp_rank: int) -> dict:
    """The amax history and ``initialized`` flags of every delayed-scaling FP8 GEMM of ``chunks``
    (GPT model chunks), under the layout-independent name of its linear (``decoder.layers.<global
    index>...fp8.amax_history``). They are the same on every rank of the amax reduction group, so
    they are stored once, like replicated weights (tp rank 0, dp rank 0 of each pipeline stage)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out = {}
    for chunk, name, module in _delayed_gemms(chunks):
        key = chunk.global_param_name(name)  # type: ignore[operator]
        for buf in ("amax_history", "initialized"):
            out[f"{key}.{buf}"] = ShardedTensor.from_rank_offsets(f"{key}.{buf}", getattr(module, buf),
                                                                  replica_id=(tp_rank, dp_rank))
    return out


def fp8_state_loaded(chunks: Sequence[nn.Module]) -> None:
    """After the histories were read into the buffers: those with entries count as warm."""
    for _, _, module in _delayed_gemms(chunks):
        module.warm = bool(module.initialized.any())
