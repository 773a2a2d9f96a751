"""Megatron-Core's fully parallel wrappers, accepted: they delegate to the wrapped strategy.

Megatron uses them to spread the writing (and reading) of replicated shards over the ranks of
``parallelization_group``. Here each main replica (``replica_id`` 0) writes its own shard and every
rank reads exactly the slices it asks for, so the wrappers change nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


class FullyParallelSaveStrategyWrapper:
    """``FullyParallelSaveStrategyWrapper(strategy, parallelization_group=None, do_cache_distribution=False,
    backend="torch_dist", version=1)``: saves with ``strategy``."""

    def __init__(
        self,
        strategy: TorchDistSaveShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        backend: str = "torch_dist",
        version: int = 1,
    ) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.backend, self.version = backend, version

    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path, async_strategy: str = "nvrx"
    ) -> Any:
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)


class FullyParallelLoadStrategyWrapper:
    """``FullyParallelLoadStrategyWrapper(strategy, parallelization_group=None, do_cache_distribution=False,
    exchange_algo="broadcast")``: loads with ``strategy``."""

    def __init__(
        self,
        strategy: TorchDistLoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo

    @property
    def stream_ckpt_dequant(self) -> bool:
        return getattr(self.base_strategy, "stream_ckpt_dequant", False)

    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path, async_strategy: str = "mcore"
    ) -> StateDict:
        return self.base_strategy.load(sharded_state_dict, checkpoint_dir, async_strategy)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)
