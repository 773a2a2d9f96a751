"""Tensor-parallel layers, autograd collectives, vocab-parallel cross entropy, RNG tracker,
activation checkpointing and micro-batch broadcast."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
)

__all__ = [
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "broadcast_data",
    "checkpoint",
    "model_parallel_cuda_manual_seed",
    "model_parallel_seed",
    "vocab_parallel_cross_entropy",
]
