"""How the trainer wraps its model chunks for data parallelism: DistributedDataParallel (gradient
buckets; the distributed optimizer) or, with FSDP (--use-torch-fsdp2, or --use-megatron-fsdp with a
sharding strategy that shards gradients), PyTorch's FSDP2 through TorchFullyShardedDataParallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron.core.distributed.meta_init import materialize_fsdp_shards_


def uses_fsdp(cfg: Any) -> bool:
    """Whether this run's chunks are sharded by FSDP2."""
    return cfg.ddp.fsdp_sharding() is not None


def model_build_device(cfg: Any, device: torch.device) -> torch.device:
    """Where the model provider builds the chunks: the meta device with FSDP2 and
    --init-model-with-meta-device (each rank then materialises only its shards), else ``device``."""
    if uses_fsdp(cfg) and cfg.model.init_model_with_meta_device:
        return torch.device("meta")
    return device


def wrap_model_chunks(cfg: Any, chunks: list[nn.Module], pg: Any, device: torch.device) -> list[Any]:
    """One data-parallel wrapper per model chunk (virtual pipeline stage), as Megatron-Core makes them:
    DistributedDataParallel or TorchFullyShardedDataParallel, which offer the schedules,
    finalize_model_grads and the checkpoint code the same methods. Chunks built on the meta device
    (``model_build_device``) get their local shards on ``device``."""
    if not uses_fsdp(cfg):
        return [DistributedDataParallel(cfg.model, cfg.ddp, c, pg) for c in chunks]
    seed = cfg.training.seed

    def materialize(chunk: nn.Module) -> None:
        materialize_fsdp_shards_(chunk, device, seed, pg.tp_rank, chunk.global_param_name)  # type: ignore[arg-type]

    wrapped: list[Any] = []
    for chunk in chunks:
        on_meta = any(p.is_meta for p in chunk.parameters())
        wrapped.append(
            TorchFullyShardedDataParallel(
                cfg.model, cfg.ddp, chunk, parallel_state=pg, init_shards=materialize if on_meta else None
            )
        )
    return wrapped


def grad_stats_group(cfg: Any, pg: Any) -> dist.ProcessGroup | None:
    """The group the optimizer sums grad norm, zero count and found-inf over: the model-parallel
    group when every data-parallel rank holds whole gradients, the world when FSDP2 shards them
    (each element then lives on one data-parallel rank)."""
    if uses_fsdp(cfg):
        return dist.group.WORLD
    return pg.mp_group  # type: ignore[no-any-return]
