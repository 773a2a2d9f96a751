"""A stack of transformer layers plus the final norm (on the last pipeline stage)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup
from megatron.core.tensor_parallel.random import checkpoint_with_rng
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import build_module

Rotary = tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class TransformerBlockSubmodules:
    """Megatron-Core's block spec: one spec per layer and the final norm. ``layer_specs`` holds a
    spec for every layer of the model (index ``layer_number - 1``) or for the layers of this
    pipeline stage only; ``layer_norm`` is accepted (the final norm is ``config.normalization``'s)."""

    layer_specs: list[Any] = field(default_factory=list)
    layer_norm: Any = None


def _layer_specs(spec: Any, num_layers: int, layer_offset: int, total_layers: int) -> list[Any]:
    """The spec of each layer ``layer_offset + 1 .. layer_offset + num_layers`` of ``spec`` (one layer
    spec shared by all, or a block spec of every layer of the model or of this stage's layers).

    Raises:
        ConfigError: a block spec whose number of layer specs is neither.
    """
    if not isinstance(spec, TransformerBlockSubmodules):
        return [spec] * num_layers
    specs = spec.layer_specs
    if len(specs) == total_layers:
        return list(specs[layer_offset : layer_offset + num_layers])
    if len(specs) == num_layers:
        return list(specs)
    raise ConfigError(
        f"TransformerBlockSubmodules.layer_specs holds {len(specs)} specs; give one per layer of the "
        f"model (num_layers {total_layers}) or of this pipeline stage ({num_layers})",
        params=("num_layers",),
    )


class TransformerBlock(nn.Module):
    """Layers ``layer_offset + 1 .. layer_offset + num_layers`` of the model (1-based global numbers).

    ``layers[i]`` is stored under its local index; ``sharded_state_dict`` maps it to the global one.
    """

    def __init__(
        self,
        config: Any,
        spec: Any,
        num_layers: int | None = None,
        layer_offset: int = 0,
        post_layer_norm: bool = True,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng_tracker: Any = None,
        cp_groups: Any = None,
        moe_groups: Any = None,
    ) -> None:
        super().__init__()
        num_layers = config.num_layers if num_layers is None else num_layers
        cp = {} if cp_groups is None else {"cp_groups": cp_groups}  # only context-parallel layers take it
        if moe_groups is not None:  # only models with experts
            cp["moe_groups"] = moe_groups
        specs = _layer_specs(spec, num_layers, layer_offset, config.num_layers)
        self.layer_offset = layer_offset
        self.rng_tracker = rng_tracker
        self.recompute = (
            (config.recompute_method, config.recompute_num_layers)
            if config.recompute_granularity == "full"
            else None
        )
        self.layers = nn.ModuleList(
            build_module(
                layer_spec,
                config,
                layer_number=layer_offset + i + 1,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
                rng_tracker=rng_tracker,
                **cp,
            )
            for i, layer_spec in enumerate(specs)
        )
        self.final_layernorm = (
            build_norm(config, config.hidden_size, sequence_parallel=sequence_parallel)
            if post_layer_norm
            else None
        )
        # Called with each layer just before it runs, outside the layer (so outside a compiled layer's
        # graph): the distributed optimizer's overlapped weight broadcast waits here.
        self.before_layer: list[Callable[[nn.Module], None]] = []

    def _run(
        self, start: int, end: int
    ) -> Callable[[torch.Tensor, torch.Tensor | None, Rotary], torch.Tensor]:
        def run_layers(
            hidden: torch.Tensor, attention_mask: torch.Tensor | None, rotary: Rotary
        ) -> torch.Tensor:
            for layer in self.layers[start:end]:
                for fn in self.before_layer:
                    fn(layer)
                hidden = layer(hidden, attention_mask, rotary)
            return hidden

        return run_layers

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, rotary: Rotary = None
    ) -> torch.Tensor:
        n = len(self.layers)
        if self.recompute is None or not self.training:
            hidden = self._run(0, n)(hidden, attention_mask, rotary)
        elif self.recompute[0] == "uniform":
            # Checkpoint the input of every chunk of `recompute_num_layers` layers.
            for start in range(0, n, self.recompute[1]):
                hidden = checkpoint_with_rng(
                    self._run(start, min(start + self.recompute[1], n)),
                    hidden,
                    attention_mask,
                    rotary,
                    tracker=self.rng_tracker,
                )
        else:  # block: recompute only the first `recompute_num_layers` layers of this stage
            for i in range(n):
                if i < self.recompute[1]:
                    hidden = checkpoint_with_rng(
                        self._run(i, i + 1), hidden, attention_mask, rotary, tracker=self.rng_tracker
                    )
                else:
                    hidden = self._run(i, i + 1)(hidden, attention_mask, rotary)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
