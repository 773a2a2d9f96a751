"""The mixture-of-experts layer: router, token dispatcher, local experts, shared experts.

``out[t] = sum_{e routed} probs[t, e] * expert_e(x[t]) (+ shared_experts(x[t]))`` for each token
of ``hidden [s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism). Children and their state-dict
names: ``router`` (``router.weight``), ``experts`` (``experts.linear_fc1.weight``,
``experts.linear_fc2.weight``), ``shared_experts`` (``shared_experts.linear_fc1.weight``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size
from megatron.core.tensor_parallel.rng_states import checkpoint_with_rng
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.spec_utils import build_module

DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


@dataclass
class MoESubmodules:
    """Megatron-Core's MoE submodules: ``experts`` (class or spec, default :class:`GroupedExperts`,
    built as ``experts(num_local_experts, config, groups)``) and ``shared_experts`` (default
    :class:`SharedExpertMLP` when ``moe_shared_expert_intermediate_size`` is set)."""

    experts: Any = None
    shared_experts: Any = None


def check_moe_layer_config(config: Any, groups: MoEGroups, tp_size: int, sequence_parallel: bool) -> None:
    """The layer's own rules (the router checks its fields itself).

    Raises:
        ConfigError: naming the field and a valid value.
    """
    num_experts = config.num_moe_experts
    if not num_experts or num_experts < 1:
        raise ConfigError(
            f"num_moe_experts must be a positive number of experts for an MoE layer, got {num_experts!r}",
            params=("num_moe_experts",),
        )
    if num_experts % groups.ep_size != 0:
        raise ConfigError(
            f"num_moe_experts ({num_experts}) is not divisible by expert_model_parallel_size "
            f"({groups.ep_size}); choose an ep size dividing the number of experts",
            params=("num_moe_experts", "expert_model_parallel_size"),
        )
    if tp_size > 1 and not sequence_parallel:
        raise ConfigError(
            f"MoE layers with tensor_model_parallel_size {tp_size} need sequence_parallel=True "
            "(--sequence-parallel), as in Megatron-Core",
            params=("sequence_parallel",),
        )
    dispatcher = getattr(config, "moe_token_dispatcher_type", "allgather")
    if dispatcher not in DISPATCHERS:
        raise ConfigError(
            f"moe_token_dispatcher_type {dispatcher!r} is not supported: use 'allgather' or 'alltoall'",
            params=("moe_token_dispatcher_type",),
        )
    if getattr(config, "fp8", None):
        raise ConfigError(
            f"fp8 ({config.fp8!r}) with experts is not supported: the expert GEMMs run in the params "
            "dtype; leave fp8 None (no --fp8-format) for MoE models",
            params=("fp8",),
        )
    if getattr(config, "moe_apply_probs_on_input", False):
        raise ConfigError(
            "moe_apply_probs_on_input is not supported: the routing probabilities weight the expert "
            "outputs; leave it False",
            params=("moe_apply_probs_on_input",),
        )


class MoELayer(nn.Module):
    """Router + dispatcher + experts (+ shared experts), in the dense MLP's slot of a layer.

    Args:
        config: a ``TransformerConfig`` with the ``moe_*`` fields and ``num_moe_experts``.
        submodules: :class:`MoESubmodules` (None: the defaults).
        layer_number: the 1-based global layer index (the router's loss / statistics row).
        tp_group: the dense tensor-parallel group (shared experts; the input is split over it along
            the sequence with sequence parallelism).
        sequence_parallel: the input is ``[s/tp, b, h]``; required when tp > 1.
        moe_groups: the MoE process groups (None: one rank).
        pg_collection: accepted for Megatron-Core's signature; the groups come from ``moe_groups``.
        compile_helpers: run the router's, the permutation's and the experts' elementwise math as
            ``torch.compile``'d kernels on CUDA (the execution plan's ``compile_helpers``).

    A compiled transformer layer runs this layer outside its graph (``torch.compiler.disable``:
    the rows per expert change every step); the kernels above are compiled on their own.

    The shared experts run after the routed experts' combine; ``moe_shared_expert_overlap`` gives
    the same results and changes nothing here.

    Raises:
        ConfigError: see :func:`check_moe_layer_config`.
    """

    def __init__(
        self,
        config: Any,
        submodules: MoESubmodules | None = None,
        layer_number: int = 1,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        moe_groups: MoEGroups | None = None,
        pg_collection: Any = None,
        compile_helpers: bool = False,
    ) -> None:
        super().__init__()
        groups = moe_groups or MoEGroups(tp=tp_group)
        tp_group = tp_group if tp_group is not None else groups.tp
        check_moe_layer_config(config, groups, group_size(tp_group), sequence_parallel)
        submodules = submodules or MoESubmodules()
        self.config = config
        self.layer_number = layer_number
        self.recompute = getattr(config, "recompute_granularity", None) == "selective" and "moe" in (
            getattr(config, "recompute_modules", None) or ()
        )
        self.num_local_experts = config.num_moe_experts // groups.ep_size
        self.local_expert_indices = [
            groups.ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)
        ]
        self.router = TopKRouter(config, groups, layer_number)
        self.experts = build_module(
            submodules.experts or GroupedExperts, self.num_local_experts, config, groups
        )
        dispatcher = DISPATCHERS[getattr(config, "moe_token_dispatcher_type", "allgather")]
        self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices, config, groups)
        exact = bool(getattr(self.token_dispatcher, "exact", False))
        for part in (self.router, self.token_dispatcher, self.experts):
            if hasattr(part, "compile_helpers"):
                part.compile_helpers = compile_helpers
        if hasattr(self.experts, "padded_rows"):
            self.experts.padded_rows = not exact
        self.shared_experts = None
        if getattr(config, "moe_shared_expert_intermediate_size", None):
            self.shared_experts = build_module(
                submodules.shared_experts or SharedExpertMLP,
                config,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
            )

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron-Core's hook: the layer's (and its router's) 1-based global index."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h]`` -> ``(out [s, b, h], None)``. With selective recompute of ``"moe"``
        (``config.recompute_modules``) the whole layer runs again in backward, keeping only its input."""
        if self.recompute and self.training:
            return checkpoint_with_rng(self._forward, hidden), None
        return self._forward(hidden), None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        probs, routing_map = self.router(hidden)  # [T, E] each, T = s * b
        rows, tokens_per_expert = self.token_dispatcher.token_dispatch(
            hidden.reshape(-1, h), probs, routing_map
        )
        out = self.token_dispatcher.token_combine(self.experts(rows, tokens_per_expert)).view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
