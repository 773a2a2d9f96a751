"""Megatron-FSDP's flags mapped onto this package's data parallelism (FSDP2 or the distributed optimizer).

``--use-megatron-fsdp --data-parallel-sharding-strategy S`` asks for ZeRO stage 0-3: ``no_shard`` is
plain data parallelism, ``optim`` the distributed optimizer, ``optim_grads`` / ``optim_grads_params``
FSDP2 (``DistributedDataParallelConfig.fsdp_sharding``). Megatron-LM's own FSDP scripts also pass
``--use-distributed-optimizer``, which Megatron-FSDP requires; under FSDP2 the optimizer state is
already sharded, so the flag is taken as asked-for and not applied twice.
"""

from __future__ import annotations


def resolve_megatron_fsdp(cfg) -> list[str]:
    """Set ``cfg.ddp`` to what ``--use-megatron-fsdp`` asks for; the log notes (one line each)."""
    d = cfg.ddp
    if not d.use_megatron_fsdp:
        return []
    strategy = d.data_parallel_sharding_strategy
    if strategy == "no_shard":
        d.use_distributed_optimizer = False
        return [
            "note: --use-megatron-fsdp with --data-parallel-sharding-strategy no_shard: plain data parallelism"
        ]
    if strategy == "optim":
        d.use_distributed_optimizer = True
        return [
            "note: --use-megatron-fsdp with --data-parallel-sharding-strategy optim: the distributed "
            "optimizer (bucket-sharded optimizer state, as --use-distributed-optimizer)"
        ]
    d.use_distributed_optimizer = False  # FSDP2 shards the optimizer state itself
    return [
        f"note: --use-megatron-fsdp with --data-parallel-sharding-strategy {strategy}: runs on PyTorch "
        "FSDP2 (fully_shard per transformer layer), "
        + (
            "parameters gathered per use (ZeRO-3)"
            if strategy == "optim_grads_params"
            else "parameters kept gathered from forward to backward (ZeRO-2)"
        )
    ]
