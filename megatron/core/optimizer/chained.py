"""Megatron-Core's ``ChainedOptimizer`` (several optimizers stepped as one); ``DistributedOptimizer``
(what ``get_megatron_optimizer`` returns for a model whose DDP wrapper shards the optimizer state)
lives in :mod:`.distrib_optimizer` and is re-exported here, where it used to be defined."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer

__all__ = ["ChainedOptimizer", "DistributedOptimizer"]


class ChainedOptimizer:
    """Steps several optimizers as one, as Megatron-Core's ``ChainedOptimizer(chained_optimizers)``.

    ``step()`` returns ``(all updated, sqrt(sum of grad_norm**2), summed zeros or None)``. Each
    optimizer clips by its own norm, so with more than one optimizer ``clip_grad`` must be 0 (the
    global clipping Megatron-Core does across them is not built).

    Raises:
        ConfigError: no optimizers, or several with ``config.clip_grad > 0``.
    """

    def __init__(self, chained_optimizers: list[MegatronOptimizer]) -> None:
        if not chained_optimizers:
            raise ConfigError(
                "chained_optimizers is empty; pass at least one optimizer", params=("chained_optimizers",)
            )
        if len(chained_optimizers) > 1 and any(o.config.clip_grad > 0 for o in chained_optimizers):
            raise ConfigError(
                "ChainedOptimizer of several optimizers clips each by its own norm, not the global "
                "one; set OptimizerConfig.clip_grad=0 on each (or chain a single optimizer)",
                params=("clip_grad",),
            )
        self.chained_optimizers = list(chained_optimizers)
        self.config = chained_optimizers[0].config

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.chained_optimizers for g in o.param_groups]

    def get_loss_scale(self) -> float:
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.chained_optimizers[0].scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.chained_optimizers:
            o.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        results = [o.step() for o in self.chained_optimizers]
        norms = [r[1] for r in results if r[1] is not None]
        zeros = [r[2] for r in results if r[2] is not None]
        return (
            all(r[0] for r in results),
            math.sqrt(sum(n * n for n in norms)) if norms else None,
            sum(zeros) if zeros else None,
        )

    def reload_model_params(self) -> None:
        for o in self.chained_optimizers:
            o.reload_model_params()

    def finish_param_sync(self) -> None:
        for o in self.chained_optimizers:
            o.finish_param_sync()

    def state_dict(self) -> list[dict[str, Any]]:
        return [o.state_dict() for o in self.chained_optimizers]

    def load_state_dict(self, state_dict: list[dict[str, Any]]) -> None:
        if len(state_dict) != len(self.chained_optimizers):
            raise CheckpointError(
                f"state_dict holds {len(state_dict)} optimizers' states; this chain has "
                f"{len(self.chained_optimizers)}"
            )
        for o, sd in zip(self.chained_optimizers, state_dict):
            o.load_state_dict(sd)
