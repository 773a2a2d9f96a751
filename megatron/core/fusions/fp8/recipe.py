"""What an FP8 run is: the recipe (formats, scaling, who runs the GEMMs), the names and sizes FP8
applies to, and the start-up questions (can this device run it, is it emulated, which layers stay
in bf16, does the SwiGLU MLP run as one FP8 block)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")
GEMM_IMPLS = ("scaled_mm", "torchao")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The linears that run in FP8 (Megatron: the transformer layers' GEMMs, never the output layer).
FP8_LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALIGN = 16  # torch._scaled_mm: every GEMM dim a multiple of 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
X, W, DY = 0, 1, 2  # rows of the amax history

# Tests only: FP8 on the CPU, its GEMMs emulated in fp32 on the dequantised fp8 values (slow), so that
# the parallel layouts can be checked with FP8 through pretrain_gpt.py on gloo. Read at start-up.
EMULATE_ENV = "MEGATRON_FP8_EMULATE"


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
    def from_config(cls, config: Any) -> Fp8Recipe | None:
        """The recipe of a ``TransformerConfig`` (None when ``fp8_format`` is not set)."""
        if not getattr(config, "fp8_format", None):
            return None
        return cls(
            config.fp8_format,
            config.fp8_recipe,
            config.fp8_amax_history_len,
            config.fp8_amax_compute_algo,
            getattr(config, "fp8_gemm_impl", "scaled_mm"),
        )

    def describe(self) -> str:
        grads = "e5m2" if self.format == "hybrid" else "e4m3"
        scaling = (
            "tensorwise scaling (current amax)"
            if self.recipe == "tensorwise"
            else f"delayed scaling (amax history {self.amax_history_len}, {self.amax_compute_algo})"
        )
        return f"{self.format} (e4m3 forward, {grads} gradients), {scaling}"

    @property
    def gemm_name(self) -> str:
        return "torchao float8 training" if self.gemm_impl == "torchao" else "torch._scaled_mm"


def torchao_error() -> str | None:
    """Why ``--fp8-gemm-impl torchao`` cannot run here (None when torchao's float8 training imports)."""
    try:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as exc:
        return (
            f"--fp8-gemm-impl torchao needs torchao's float8 training ({exc}); pip install torchao, or use "
            "--fp8-gemm-impl scaled_mm (the default)"
        )
    return None


def fp8_emulated(device: torch.device) -> bool:
    """FP8 runs emulated: a CPU run with ``MEGATRON_FP8_EMULATE=1`` (tests of the layouts). Reads the
    environment: call it once at start-up and pass the answer on."""
    return torch.device(device).type == "cpu" and os.environ.get(EMULATE_ENV) == "1"


def fp8_device_error(device: torch.device, emulated: bool = False) -> str | None:
    """Why ``device`` cannot run the FP8 GEMMs (None when it can: CUDA, compute capability 9.0+, or
    ``emulated``, :func:`fp8_emulated`'s answer)."""
    device = torch.device(device)
    if emulated:
        return None
    if device.type != "cuda":
        return (
            f"fp8_format needs an H100/H200-class GPU (Hopper, compute capability 9.0 or newer); this run "
            f"is on the {device.type.upper()}. Leave fp8_format unset to train in bf16"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (
            f"fp8_format needs an H100/H200-class GPU (Hopper, compute capability 9.0 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}. "
            "Leave fp8_format unset to train in bf16"
        )
    return None


def bf16_layer_numbers(config: Any) -> set[int]:
    """The global 1-based numbers of the transformer layers that ``first_last_layers_bf16`` keeps in bf16."""
    if not getattr(config, "first_last_layers_bf16", False):
        return set()
    n = config.num_layers
    return {
        i
        for i in range(1, n + 1)
        if i <= config.num_layers_at_start_in_bf16 or i > n - config.num_layers_at_end_in_bf16
    }


def swiglu_mlp_fusable(config: Any) -> bool:
    """Whether this model's SwiGLU MLPs run as one FP8 block (:class:`Fp8SwigluMlp`): delayed scaling
    with our GEMMs, SwiGLU, no biases."""
    recipe = Fp8Recipe.from_config(config)
    return (
        recipe is not None
        and recipe.recipe == "delayed"
        and recipe.gemm_impl == "scaled_mm"
        and getattr(config, "activation", None) == "swiglu"
        and not getattr(config, "add_bias_linear", True)
    )
