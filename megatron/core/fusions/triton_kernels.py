"""The Triton kernels under their former module path: a re-export of :mod:`megatron.core.fusions.triton`
(kernels, self-checks, :class:`TritonKernels`) and :mod:`megatron.core.fusions.swiglu`."""

from megatron.core.fusions.swiglu import SwiGLU, swiglu_torch, swiglu_triton
from megatron.core.fusions.triton import KERNELS, SELF_CHECKS, TritonKernels, passed, self_check, triton
from megatron.core.fusions.triton.cross_entropy import cross_entropy_grad_triton
from megatron.core.fusions.triton.fp8_cast import (
    fp8_amax,
    fp8_amax_triton,
    fp8_cast_transpose,
    fp8_cast_transpose_amax,
    fp8_cast_transpose_triton,
)
from megatron.core.fusions.triton.swiglu import (
    swiglu_backward,
    swiglu_backward_torch,
    swiglu_backward_triton,
    swiglu_fp32,
)
from megatron.core.fusions.triton.swiglu_fp8 import (
    swiglu_backward_cast_transpose_amax,
    swiglu_backward_cast_transpose_amax_triton,
    swiglu_cast_transpose_amax,
    swiglu_cast_transpose_amax_triton,
)

__all__ = [
    "KERNELS",
    "SELF_CHECKS",
    "SwiGLU",
    "TritonKernels",
    "cross_entropy_grad_triton",
    "fp8_amax",
    "fp8_amax_triton",
    "fp8_cast_transpose",
    "fp8_cast_transpose_amax",
    "fp8_cast_transpose_triton",
    "passed",
    "self_check",
    "swiglu_backward",
    "swiglu_backward_cast_transpose_amax",
    "swiglu_backward_cast_transpose_amax_triton",
    "swiglu_backward_torch",
    "swiglu_backward_triton",
    "swiglu_cast_transpose_amax",
    "swiglu_cast_transpose_amax_triton",
    "swiglu_fp32",
    "swiglu_torch",
    "swiglu_triton",
    "triton",
]
