"""Data-parallel training: gradient buffers, reduction and finalisation."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "TorchFullyShardedDataParallel",
    "finalize_model_grads",
]
