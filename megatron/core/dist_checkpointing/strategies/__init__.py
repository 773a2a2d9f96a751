"""Save and load strategies. One backend is implemented, ``torch_dist`` (PyTorch DCP, see
``dist_checkpointing.torch_dist``); the strategy classes carry Megatron-Core's names and options and
delegate to ``dist_checkpointing.save`` / ``load``."""

from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)

__all__ = [
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
]
