"""The run's execution plan at start-up: resolved before the model is built, the FP8 amax reducer the
trainer owns, the compile of the built layers, the ``> kernels`` report of that same plan, and the
start-up lines of the context-parallel layout."""

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
from megatron.training.validation_moe import expert_layout_line


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
    data- and context-parallel ranks of this pipeline stage (``tp_only``: the tensor- and
    context-parallel ones);
    None without delayed scaling or when that group is this rank alone."""
    if plan.fp8 is None or plan.fp8.recipe.recipe != "delayed":
        return None
    # cp ranks see other tokens of the same weights: they share scales even with tp_only (Megatron's
    # amax group with context parallelism is tp x cp).
    ranks = "tp_cp" if tp_only else "tp_dp_cp"
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


def _comm_type_runs(types: list[str], num_layers: int) -> str:
    """``p2p`` for one type, else ``layers 1-2 a2a, 3-4 p2p`` (runs of equal types)."""
    if len(set(types)) == 1:
        return types[0]
    runs: list[list] = []
    for layer, t in enumerate(types, start=1):
        if runs and runs[-1][2] == t:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, t])
    return "layers " + ", ".join(f"{a}-{b} {t}" if a != b else f"{a} {t}" for a, b, t in runs)


def layout_lines(cfg: Any, world_size: int = 1) -> list[str]:
    """The start-up lines of the context-parallel and expert layouts (none without them) and, with
    --reset-attention-mask, of the attention FLOPs convention of the logged TFLOP/s and MFU."""
    m, s = cfg.model, cfg.training.seq_length
    lines = []
    cp = m.context_parallel_size
    if cp > 1:
        types = m.cp_comm_type or ["p2p"]
        types = [types] if isinstance(types, str) else list(types)
        hcp = m.hierarchical_context_parallel_sizes
        levels = f" (a2a over {hcp[0]} ranks, p2p ring over {hcp[1]})" if hcp and "a2a+p2p" in types else ""
        lines.append(
            f" > context parallelism: cp {cp}, each sequence of {s} tokens in {2 * cp} chunks of "
            f"{s // (2 * cp)}, rank r holding chunks r and {2 * cp - 1}-r; comm type "
            f"{_comm_type_runs(types, m.num_layers)}{levels}; gradients reduced over dp x cp"
        )
    if m.num_moe_experts:
        lines.append(" > " + expert_layout_line(cfg, world_size))
    if cfg.data.reset_attention_mask:
        lines.append(
            " > attention FLOPs (TFLOP/s, MFU): full causal attention over each sequence, as Megatron counts "
            "it, not the document-masked attention that --reset-attention-mask runs"
        )
    return lines
