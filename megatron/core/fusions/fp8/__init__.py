"""FP8 GEMMs for the tensor-parallel linears (QKV, proj, fc1, fc2) on Hopper, with ``torch._scaled_mm``.

FP8 is compute only: weights, their gradients and the optimizer stay in bf16 / fp32, checkpoints are
unchanged. For ``Y = X W^T`` the forward quantises ``X`` and ``W`` to e4m3 with one fp32 scale per
tensor; the backward quantises ``dY`` (e5m2 for ``hybrid``, e4m3 for ``e4m3``, as Transformer Engine
and Megatron define the formats) and computes ``dX = dY W`` and ``dW = dY^T X`` in FP8 as well.

* :mod:`.recipe`: :class:`Fp8Recipe` and the start-up questions (device, emulation, bf16 layers);
* :mod:`.scaling`: the one definition of the scale from an amax and of delayed scaling's history;
* :mod:`.gemm`: the GEMM's autograd functions (current scaling, delayed scaling, evaluation);
* :mod:`.module`: :class:`Fp8Gemm` (one linear's scaling state) and :class:`AmaxReducer`;
* :mod:`.swiglu_mlp`: :class:`Fp8SwigluMlp`, fc1 -> SwiGLU -> fc2 as one FP8 block;
* :mod:`.torchao`: ``--fp8-gemm-impl torchao`` (optional dependency);
* :mod:`.checkpoint`: the amax histories in checkpoints.

The numerics are one code path for every device: quantise -> :func:`scaled_mm`, which calls
``torch._scaled_mm`` or, with ``use_scaled_mm=False``, multiplies the dequantised fp8 values in fp32
(FP8 emulated on the CPU; the eager reference the tests compare against is tests/fp8_reference.py).
"""

from megatron.core.fusions.fp8.checkpoint import fp8_sharded_state_dict, fp8_state_loaded
from megatron.core.fusions.fp8.gemm import fp8_matmul
from megatron.core.fusions.fp8.module import AmaxReducer, Fp8Gemm
from megatron.core.fusions.fp8.recipe import (
    ALIGN,
    AMAX_COMPUTE_ALGOS,
    DY,
    E4M3,
    E5M2,
    EMULATE_ENV,
    FORMATS,
    FP8_LINEAR_NAMES,
    GEMM_IMPLS,
    RECIPES,
    Fp8Recipe,
    W,
    X,
    bf16_layer_numbers,
    fp8_device_error,
    fp8_emulated,
    swiglu_mlp_fusable,
    torchao_error,
)
from megatron.core.fusions.fp8.scaling import quantize, scale_from_amax, scaled_mm
from megatron.core.fusions.fp8.swiglu_mlp import Fp8SwigluMlp

__all__ = [
    "ALIGN",
    "AMAX_COMPUTE_ALGOS",
    "DY",
    "E4M3",
    "E5M2",
    "EMULATE_ENV",
    "FORMATS",
    "FP8_LINEAR_NAMES",
    "GEMM_IMPLS",
    "RECIPES",
    "W",
    "X",
    "AmaxReducer",
    "Fp8Gemm",
    "Fp8Recipe",
    "Fp8SwigluMlp",
    "bf16_layer_numbers",
    "fp8_device_error",
    "fp8_emulated",
    "fp8_matmul",
    "fp8_sharded_state_dict",
    "fp8_state_loaded",
    "quantize",
    "scale_from_amax",
    "scaled_mm",
    "swiglu_mlp_fusable",
    "torchao_error",
]
