"""Shared experts: a dense MLP of ``moe_shared_expert_intermediate_size`` that every token passes
through beside its routed experts, tensor-parallel over the dense tp group like the dense MLP.

With ``moe_shared_expert_gate`` the output is scaled per token by ``sigmoid(x @ gate_weight^T)``
(``gate_weight`` ``[1, h]``, replicated; its gradient is summed over tp with sequence parallelism).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.init import set_init_attrs, tag_param
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size
from megatron.core.transformer.mlp import MLP, MLPSubmodules


class SharedExpertMLP(MLP):
    """``[s, b, h]`` -> ``[s, b, h]``: the dense MLP with ``F = moe_shared_expert_intermediate_size``,
    plus the optional sigmoid gate. Parameters: ``linear_fc1.weight``, ``linear_fc2.weight`` (and
    biases with ``add_bias_linear``), ``gate_weight`` with the gate.

    Args:
        config: a ``TransformerConfig`` with ``moe_shared_expert_intermediate_size`` set.
        submodules: the linears (default column- / row-parallel).
        tp_group / sequence_parallel: as the dense MLP's.
    """

    def __init__(
        self,
        config: Any,
        submodules: MLPSubmodules | None = None,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        shared = copy.copy(config)
        shared.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        submodules = submodules or MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        )
        super().__init__(shared, submodules, tp_group, sequence_parallel)
        self.gate_weight: nn.Parameter | None = None
        if getattr(config, "moe_shared_expert_gate", False):
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
            with torch.no_grad():
                self.gate_weight.normal_(0.0, config.init_method_std)
            set_init_attrs(self.gate_weight, std=config.init_method_std)
            tag_param(self.gate_weight, sequence_parallel=sequence_parallel and group_size(tp_group) > 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> the same shape."""
        out, bias = super().forward(hidden)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden, self.gate_weight))
        return out
