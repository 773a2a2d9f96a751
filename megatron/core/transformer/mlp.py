"""The feed-forward block: fc1 (column-parallel), GELU or SwiGLU, fc2 (row-parallel).

GELU follows Megatron-LM: a model with biases uses the tanh approximation (Megatron-LM's fused
bias-GELU, on by default), ``--no-bias-gelu-fusion`` or a model without biases the exact erf GELU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.fusions import triton_kernels
from megatron.core.fusions.fp8 import Fp8SwigluMlp
from megatron.core.transformer.spec_utils import build_module


@dataclass
class MLPSubmodules:
    """fc1 and fc2 (classes or specs); Megatron-Core's ``activation_func`` (a Transformer Engine
    activation module) must stay None: the activation is the config's."""

    linear_fc1: object = None
    linear_fc2: object = None
    activation_func: object = None


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where the last dim of ``x`` is ``[gate; up]``. On CUDA with Triton the backward
    is one kernel that reads each input once (:mod:`megatron.core.fusions.triton_kernels`)."""
    if x.is_cuda and triton_kernels.triton is not None:
        return triton_kernels.SwiGLU.apply(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """``h -> F -> h``. With SwiGLU, fc1 produces ``[gate; up]`` (2F rows, each half split across tp)."""

    def __init__(self, config, submodules: MLPSubmodules, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        if getattr(submodules, "activation_func", None) is not None:
            raise ValueError("MLPSubmodules.activation_func is not supported here: the activation is "
                             "TransformerConfig's (activation_func / gated_linear_unit); leave it None")
        gated = config.activation == "swiglu"
        approximate = config.gelu_approximation
        self.activation = swiglu if gated else functools.partial(F.gelu, approximate=approximate)
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=config.params_dtype,
                      bias=config.add_bias_linear)
        self.linear_fc1 = build_module(
            submodules.linear_fc1, config.hidden_size, config.ffn_hidden_size * (2 if gated else 1),
            init_std=config.init_method_std, partition_stride=2 if gated else 1, **common,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2, config.ffn_hidden_size, config.hidden_size,
            init_std=config.output_layer_init_std, skip_bias_add=True, **common,
        )

        # set by fusions.fp8.apply_fp8: fc1 -> SwiGLU -> fc2 may run as one FP8 block (fp8.Fp8SwigluMlp)
        self.fp8_swiglu: Fp8SwigluMlp | None = None

    def forward(self, hidden: torch.Tensor):
        """``[s, b, h]`` -> ``(output [s, b, h], bias or None)``."""
        if self.fp8_swiglu is not None and self.fp8_swiglu.ready():
            fc1, fc2 = self.linear_fc1, self.linear_fc2
            out = self.fp8_swiglu(fc1.input_collective(hidden), fc1.weight, fc2.weight)
            return fc2.output_collective(out), None
        x, _ = self.linear_fc1(hidden)
        return self.linear_fc2(self.activation(x))
