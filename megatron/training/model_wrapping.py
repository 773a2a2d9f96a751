"""How the trainer wraps its model chunks for data parallelism: DistributedDataParallel (gradient
buckets; the distributed optimizer) or, with FSDP (--use-torch-fsdp2, or --use-megatron-fsdp with a
sharding strategy that shards gradients), PyTorch's FSDP2 through TorchFullyShardedDataParallel."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel


def uses_fsdp(cfg: Any) -> bool:
    """Whether this run's chunks are sharded by FSDP2."""
    return cfg.ddp.fsdp_sharding() is not None


def wrap_model_chunks(cfg: Any, chunks: list[nn.Module], pg: Any) -> list[nn.Module]:
    """One data-parallel wrapper per model chunk (virtual pipeline stage), as Megatron-Core makes them."""
    if not uses_fsdp(cfg):
        return [DistributedDataParallel(cfg.model, cfg.ddp, c, pg) for c in chunks]
    return [TorchFullyShardedDataParallel(cfg.model, cfg.ddp, c, parallel_state=pg) for c in chunks]


def grad_stats_group(cfg: Any, pg: Any) -> dist.ProcessGroup | None:
    """The group the optimizer sums grad norm, zero count and found-inf over: the model-parallel
    group when every data-parallel rank holds whole gradients, the world when FSDP2 shards them
    (each element then lives on one data-parallel rank)."""
    if uses_fsdp(cfg):
        return dist.group.WORLD
    return pg.mp_group  # type: ignore[no-any-return]
