"""GPTModel's output layer + loss paths, one class each; the execution plan picks one at construction.

Each is called as ``loss(hidden [s, b, h], output_layer, weight, labels [b, s], loss_mask [b, s] or
None) -> [b, s]`` fp32 per-token losses; ``weight`` is the tied embedding weight (None: the output
layer's own).
"""

from __future__ import annotations

import torch

from megatron.core.execution_plan import ExecutionPlan
from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import sharded_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import ProcessGroup


class FusedLinearCrossEntropy:
    """One rank holds the whole vocabulary: output layer + cross entropy in token chunks, never the
    full logits (``fusions.linear_cross_entropy``); its per-row pass is a Triton kernel
    (``use_triton``), compiled torch ops (``compiled``) or eager torch ops. The gradient reaching the
    losses must be one scalar times ``loss_mask`` (all ones when None), as a masked mean gives."""

    def __init__(self, use_triton: bool, compiled: bool) -> None:
        self.use_triton, self.compiled = use_triton, compiled

    def __call__(
        self,
        hidden: torch.Tensor,
        output_layer: ColumnParallelLinear,
        weight: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        w = weight if weight is not None else output_layer.weight
        assert w is not None
        weights = None if loss_mask is None else loss_mask.t()
        loss = linear_cross_entropy(
            hidden, w, labels.t(), loss_weights=weights, use_triton=self.use_triton, compile=self.compiled
        )
        return loss.t().contiguous()  # [b, s]


class LogitsCrossEntropy:
    """The output layer's logits ``[s, b, V/tp]``, then the (vocab-parallel) cross entropy over them."""

    def __init__(self, tp_group: ProcessGroup | None) -> None:
        self.tp_group = tp_group

    def __call__(
        self,
        hidden: torch.Tensor,
        output_layer: ColumnParallelLinear,
        weight: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        logits, _ = output_layer(hidden, weight=weight)  # [s, b, V/tp]
        return sharded_cross_entropy(logits, labels.t(), self.tp_group).t().contiguous()  # [b, s]


OutputLoss = FusedLinearCrossEntropy | LogitsCrossEntropy


def output_loss(plan: ExecutionPlan, tp_group: ProcessGroup | None) -> OutputLoss:
    """The loss path ``plan.cross_entropy`` names."""
    if plan.fused_cross_entropy:
        return FusedLinearCrossEntropy(
            use_triton=plan.cross_entropy == "fused_triton", compiled=plan.compile_helpers
        )
    return LogitsCrossEntropy(tp_group)
