"""Megatron-Core's ``megatron.core.tensor_parallel.random``: the RNG tracker, the seeding entry points
and activation checkpointing that replays the tracker's states.

The tracker and ``checkpoint_with_rng`` live in :mod:`rng_states`, the Megatron-Core entry points over
the default tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker``, ...) in :mod:`rng_api`
and the recompute classes in :mod:`recompute`; this module re-exports them under Megatron's path.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.recompute import CheckpointWithoutOutput, checkpoint
from megatron.core.tensor_parallel.rng_api import (
    CudaRNGStatesTracker,
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.rng_states import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint_with_rng,
    model_parallel_seed,
)

__all__ = [
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "checkpoint_with_rng",
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_seed",
]
