"""Data-parallel training: gradient buffers, reduction and finalisation."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads"]
