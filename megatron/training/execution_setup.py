"""The run's execution plan at start-up: resolved before the model is built, the FP8 amax reducer the
trainer owns, the compile of the built layers, and the ``> kernels`` report of that same plan."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from megatron.core.execution_plan import ExecutionPlan, resolve
from megatron.core.fusions.compile import compile_layers
from megatron.core.fusions.fp8 import EMULATE_ENV, AmaxReducer
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.transformer_layer import TransformerLayer


def resolve_plan(
    cfg: Any, device: torch.device, tp_size: int, environ: Mapping[str, str] = os.environ
) -> ExecutionPlan:
    """The plan of this run: its model config, ``--torch-compile``, the device and the Triton kernels'
    self-checks (run now); ``TRITON_INTERPRET`` and ``MEGATRON_FP8_EMULATE`` are read here, once.

    Raises:
        ConfigError: FP8 asked on a device that cannot run it.
    """
    return resolve(
        cfg.model,
        device,
        tp_size,
        torch_compile=cfg.impl.torch_compile != "off",
        compile_off_reason="--torch-compile off",
        interpret=environ.get("TRITON_INTERPRET") == "1",
        fp8_emulate=environ.get(EMULATE_ENV) == "1",
    )


def amax_reducer(plan: ExecutionPlan, pg: ParallelState, tp_only: bool) -> AmaxReducer | None:
    """Delayed FP8 scaling's amax reduction (max) across the ranks that must share scales: the tensor-,
    data- and context-parallel ranks of this pipeline stage (``tp_only``: the tensor-parallel ones);
    None without delayed scaling or when that group is this rank alone."""
    if plan.fp8 is None or plan.fp8.recipe.recipe != "delayed":
        return None
    ranks = "tp" if tp_only else "tp_dp_cp"
    if len(pg.group_ranks.get(ranks, [])) <= 1:
        return None
    return AmaxReducer(pg.groups.get(ranks))


def apply_compile_choice(cfg: Any, plan: ExecutionPlan) -> None:
    """DDP's gradient copies and the fused AdamW step compile where the plan compiles its helpers
    (``cfg.ddp`` / ``cfg.optimizer`` ``compile_helpers``, read when DDP and the optimizer are built)."""
    cfg.ddp.compile_helpers = plan.compile_helpers
    cfg.optimizer.compile_helpers = plan.compile_helpers


def compile_model(plan: ExecutionPlan, chunks: list[nn.Module]) -> int:
    """``torch.compile`` of each transformer layer where the plan says so; how many were compiled."""
    return compile_layers(chunks, TransformerLayer) if plan.compile_layers else 0
