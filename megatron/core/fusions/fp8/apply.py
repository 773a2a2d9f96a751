"""Model surgery after construction: give the transformer linears of a built model their FP8 GEMMs.
Interim: the execution plan builds the FP8 GEMMs at construction, through the layer spec; this goes
away with its last caller."""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn

from megatron.core.fusions.fp8.module import AmaxReducer, Fp8Gemm
from megatron.core.fusions.fp8.recipe import (
    ALIGN,
    EMULATE_ENV,
    FP8_LINEAR_NAMES,
    Fp8Recipe,
    bf16_layer_numbers,
    fp8_device_check,
    fp8_emulated,
    swiglu_mlp_fusable,
)
from megatron.core.fusions.fp8.swiglu_mlp import Fp8SwigluMlp
from megatron.core.fusions.triton import TritonKernels, passed, self_check


def _bf16_layer_linears(modules: list[nn.Module], config: Any) -> set[int]:
    """``id`` of every module inside a transformer layer kept in bf16 (its global ``layer_number``)."""
    numbers = bf16_layer_numbers(config)
    return {
        id(m)
        for root in modules
        for layer in root.modules()
        if type(layer).__name__ == "TransformerLayer" and getattr(layer, "layer_number", None) in numbers
        for m in layer.modules()
    }


def apply_fp8(
    modules: list[nn.Module],
    config: Any,
    device: torch.device,
    amax_group: Any = None,
    *,
    kernels: TritonKernels | None = None,
    emulated: bool | None = None,
) -> int:
    """Give every QKV / proj / fc1 / fc2 linear of ``modules`` an :class:`Fp8Gemm`; returns how many.

    ``amax_group``: with delayed scaling, the process group over which each amax is reduced (max)
    before it enters the history (one :class:`AmaxReducer` for all of them); None: this rank's own.
    ``kernels``: the run's Triton kernels (None: self-checked on ``device`` now); ``emulated``: FP8
    emulated on the CPU (None: :func:`fp8_emulated`).

    Does nothing without ``config.fp8_format``. Raises ConfigError (naming ``fp8_format``) when the
    device cannot run FP8; linears whose weight dims are not multiples of 16 stay in bf16, with one
    warning naming them, as do those of the layers ``first_last_layers_bf16`` keeps in bf16.
    """
    recipe = Fp8Recipe.from_config(config)
    if recipe is None:
        return 0
    emulated = fp8_emulated(device) if emulated is None else emulated
    fp8_device_check(device, emulated)
    if kernels is None:
        kernels = passed(self_check(torch.device(device)))
    if emulated:
        warnings.warn(
            f"FP8 emulated on the CPU ({EMULATE_ENV}=1): fp32 GEMMs on the dequantised fp8 values, "
            "for tests only",
            stacklevel=2,
        )
    reducer = AmaxReducer(amax_group) if amax_group is not None and recipe.recipe == "delayed" else None
    count, skipped = 0, []
    in_bf16 = _bf16_layer_linears(modules, config)
    for root in modules:
        for name, module in root.named_modules():
            module = cast(Any, module)
            if not hasattr(module, "fp8") or not (
                hasattr(module, "input_collective") or hasattr(module, "output_collective")
            ):
                continue  # not a column/row-parallel linear
            if (
                name.rsplit(".", 1)[-1] not in FP8_LINEAR_NAMES
                or module.weight is None
                or id(module) in in_bf16
            ):
                continue
            n, k = module.weight.shape
            if n % ALIGN or k % ALIGN:
                skipped.append(f"{name} [{n}, {k}]")
                continue
            extra = {"use_scaled_mm": False} if emulated else {}
            module.fp8 = Fp8Gemm(
                recipe, device=module.weight.device, reducer=reducer, kernels=kernels, **extra
            )
            count += 1
    _fuse_swiglu_mlps(modules, config, kernels)
    if skipped:
        warnings.warn(
            f"FP8: {len(skipped)} linears keep bf16 GEMMs because a weight dim is not a multiple of "
            f"{ALIGN}: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}",
            stacklevel=2,
        )
    return count


def _fuse_swiglu_mlps(modules: list[nn.Module], config: Any, kernels: TritonKernels) -> None:
    """Where :func:`swiglu_mlp_fusable` allows it, give every SwiGLU MLP whose fc1 and fc2 both run in
    FP8 (not a layer ``first_last_layers_bf16`` keeps in bf16; no bias, no output gather) an
    :class:`Fp8SwigluMlp`."""
    if not swiglu_mlp_fusable(config):
        return
    for root in modules:
        for mlp in root.modules():
            mlp = cast(Any, mlp)
            if not hasattr(mlp, "fp8_swiglu") or not hasattr(mlp, "linear_fc1"):
                continue
            fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
            if (
                isinstance(fc1.fp8, Fp8Gemm)
                and isinstance(fc2.fp8, Fp8Gemm)
                and fc1.bias is None
                and fc2.bias is None
                and not fc1.gather_output
            ):
                mlp.fp8_swiglu = Fp8SwigluMlp(fc1.fp8, fc2.fp8, activation=mlp.activation, kernels=kernels)
