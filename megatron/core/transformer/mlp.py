"""The feed-forward block: fc1 (column-parallel), GELU or SwiGLU, fc2 (row-parallel).

GELU follows Megatron-LM: a model with biases uses the tanh approximation (Megatron-LM's fused
bias-GELU, on by default), ``--no-bias-gelu-fusion`` or a model without biases the exact erf GELU.

Variants come from the layer spec (``execution_plan`` decides them at start-up): the activation
through ``MLPSubmodules.activation_func`` (:func:`swiglu` or :func:`swiglu_triton_backward`), the
linears' GEMMs through their ``fp8_gemm`` parameter, and :class:`Fp8SwigluMLP` for the FP8 block.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.fusions.fp8 import Fp8Gemm, Fp8SwigluMlp
from megatron.core.fusions.swiglu import swiglu_torch, swiglu_triton
from megatron.core.tensor_parallel.mappings import ProcessGroup
from megatron.core.transformer.spec_utils import build_module

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MLPSubmodules:
    """fc1 and fc2 (classes or specs), and Megatron-Core's ``activation_func``: None for the config's
    activation (:func:`config_activation`), or a function of fc1's output (``[..., 2F]`` ``[gate; up]``
    with SwiGLU) returning the activation ``[..., F]``, such as :func:`swiglu_triton_backward`."""

    linear_fc1: Any = None
    linear_fc2: Any = None
    activation_func: Any = None


# SiLU(gate) * up over the last dim ``[gate; up]``: the torch ops, or (``swiglu_triton_backward``)
# computed in fp32 and rounded once with a backward that is one Triton kernel (fusions.swiglu; the
# plan picks it where the kernel passed its self-check).
swiglu = swiglu_torch
swiglu_triton_backward = swiglu_triton


def config_activation(config: Any) -> Activation:
    """The activation the config names: SwiGLU (torch ops) or GELU with its approximation."""
    if config.activation == "swiglu":
        return swiglu
    return functools.partial(F.gelu, approximate=config.gelu_approximation)


def _activation(config: Any, given: Any) -> Activation:
    if given is None:
        return config_activation(config)
    if isinstance(given, types.FunctionType):
        return given
    raise ConfigError(
        f"MLPSubmodules.activation_func is not supported here as {given!r}: give a function of "
        "fc1's output (e.g. megatron.core.transformer.mlp.swiglu), or leave it None for the "
        "config's activation (activation_func / gated_linear_unit)",
        params=("activation_func",),
    )


class MLP(nn.Module):
    """``h -> F -> h``. With SwiGLU, fc1 produces ``[gate; up]`` (2F rows, each half split across tp)."""

    def __init__(
        self,
        config: Any,
        submodules: MLPSubmodules,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        gated = config.activation == "swiglu"
        self.activation = _activation(config, getattr(submodules, "activation_func", None))
        common = dict(
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype,
            bias=config.add_bias_linear,
        )
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            config.hidden_size,
            config.ffn_hidden_size * (2 if gated else 1),
            init_std=config.init_method_std,
            partition_stride=2 if gated else 1,
            **common,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            config.ffn_hidden_size,
            config.hidden_size,
            init_std=config.output_layer_init_std,
            skip_bias_add=True,
            **common,
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> ``(output [s, b, h], bias or None)``."""
        x, _ = self.linear_fc1(hidden)
        out: tuple[torch.Tensor, torch.Tensor | None] = self.linear_fc2(self.activation(x))
        return out


class Fp8SwigluMLP(MLP):
    """A SwiGLU MLP whose fc1 and fc2 run in FP8 with delayed scaling, computed as one block
    (``fusions.fp8.Fp8SwigluMlp``: SwiGLU's output and gradient quantised inside SwiGLU's own passes)
    between fc1's input collective and fc2's output collective. The block uses, and updates, the two
    linears' own FP8 state, so checkpoints and the amax reduction see two FP8 linears.

    The block gives the two linears' numerics exactly once both amax histories are warm and a
    backward follows (``Fp8SwigluMlp.ready``); until then, and in evaluation, the two linears run.

    Raises:
        ConfigError: fc1 or fc2 without an FP8 GEMM, with a bias, or fc1 gathering its output.
    """

    def __init__(
        self,
        config: Any,
        submodules: MLPSubmodules,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(config, submodules, tp_group, sequence_parallel)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if (
            not (isinstance(fc1.fp8, Fp8Gemm) and isinstance(fc2.fp8, Fp8Gemm))
            or config.activation != "swiglu"
            or fc1.bias is not None
            or fc2.bias is not None
            or fc1.gather_output
        ):
            raise ConfigError(
                "Fp8SwigluMLP needs a SwiGLU MLP without biases (add_bias_linear=False) whose fc1 and "
                "fc2 have FP8 GEMMs (the layer spec's fp8_gemm); use MLP otherwise",
                params=("add_bias_linear",),
            )
        self.fp8_swiglu = Fp8SwigluMlp(fc1.fp8, fc2.fp8, activation=self.activation, kernels=fc1.fp8.kernels)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> ``(output [s, b, h], None)``."""
        if not self.fp8_swiglu.ready():
            return super().forward(hidden)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        out = self.fp8_swiglu(fc1.input_collective(hidden), fc1.weight, fc2.weight)
        return fc2.output_collective(out), None
