"""DistributedDataParallelConfig: how gradients are buffered and reduced across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import ConfigError, check_choice, doc

# Megatron-FSDP's --data-parallel-sharding-strategy values, ZeRO-0 to ZeRO-3.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = doc(
        True, "Accumulate and reduce gradients in fp32 main-grad buffers (bf16/fp16 params).", flag=None
    )
    overlap_grad_reduce: bool = doc(False, "Reduce gradient buckets during backward as they become ready.")
    use_distributed_optimizer: bool = doc(
        False,
        "Shard the optimizer over the data-parallel ranks (ZeRO-1, Megatron's layout): each gradient bucket "
        "is padded to a multiple of lcm(DP, 128) and DP rank r owns its slice [r*len/DP, (r+1)*len/DP); "
        "buckets are reduce-scattered, only the owned elements' fp32 main params and Adam moments are kept "
        "and updated, and one all-gather per bucket refreshes the weights. Optimizer memory per GPU drops "
        "about DP-fold; checkpoints keep the plain optimizer's layout.",
    )
    overlap_param_gather: bool = doc(
        False,
        "With --use-distributed-optimizer: the all-gathers of the updated weights (one per bucket) run "
        "during the next forward pass instead of after the step; each layer waits only for its own "
        "buckets. Needs --overlap-grad-reduce.",
    )
    bucket_size: int | None = doc(
        None,
        "Gradient bucket size in elements (buckets are also the unit in which gradient "
        "memory is allocated during backward); default max(40M, 1M x DP).",
        flag="--ddp-bucket-size",
    )
    average_in_collective: bool = doc(
        False, "Average in the collective instead of pre-scaling by 1/DP.", flag="--ddp-average-in-collective"
    )
    alias_single_gradients: bool = doc(
        True,
        "Use a parameter's only gradient of the step as its main grad as is, without copying it into "
        "the bucket: without data-parallel reduction always (exact: the optimizer reads it in fp32), with "
        "it where the parameter's dtype is the reduction's (then reduced in place). A second micro-batch "
        "moves it into the bucket, so accumulation still sums in the bucket's dtype.",
        flag=None,
    )
    compile_helpers: bool = doc(
        True,
        "On CUDA, run the gradient copy into the bucket and the accumulation of later micro-batches as "
        "torch.compile'd kernels (same values as eager); the training application takes it from its "
        "execution plan (off with --torch-compile off). No effect on the CPU.",
        flag=None,
    )
    use_torch_fsdp2: bool = doc(
        False,
        "Fully sharded data parallelism with PyTorch's FSDP2 (fully_shard per transformer layer and per "
        "model chunk): parameters, gradients and optimizer state sharded over the data-parallel ranks, "
        "composed with tensor and pipeline parallelism; compute in the run's bf16/fp16, gradients "
        "reduced in fp32, sharded parameters kept in fp32 as the optimizer's main parameters.",
    )
    torch_fsdp2_reshard_after_forward: bool = doc(
        True,
        "FSDP2: free each layer's gathered parameters after its forward (gathered again for backward, "
        "ZeRO-3); off keeps them until backward (ZeRO-2: more memory, one all-gather less per layer).",
        flag="--torch-fsdp2-no-reshard-after-forward",
    )
    use_megatron_fsdp: bool = doc(
        False,
        "Megatron-FSDP's flag: runs on PyTorch FSDP2 here, with --data-parallel-sharding-strategy "
        "choosing what is sharded (no_shard: plain data parallelism; optim: the distributed optimizer; "
        "optim_grads / optim_grads_params: FSDP2 with parameters gathered until backward / per use). Its "
        "buffer tuning flags have no effect.",
    )
    data_parallel_sharding_strategy: str = doc(
        "optim_grads_params",
        "With --use-megatron-fsdp: what the data-parallel ranks shard, ZeRO-0 to ZeRO-3 "
        "(no_shard, optim, optim_grads, optim_grads_params).",
        choices=SHARDING_STRATEGIES,
    )

    def __post_init__(self) -> None:
        check_choice(
            "data_parallel_sharding_strategy", self.data_parallel_sharding_strategy, SHARDING_STRATEGIES
        )
        if self.use_torch_fsdp2 and self.use_megatron_fsdp:
            raise ConfigError(
                "use_torch_fsdp2 and use_megatron_fsdp both ask for fully sharded data parallelism; "
                "set one of them (both run on FSDP2 here)",
                params=("use_torch_fsdp2", "use_megatron_fsdp"),
            )

    def fsdp_sharding(self) -> str | None:
        """What FSDP2 shards: None (no FSDP), ``"optim_grads"`` (ZeRO-2: a layer's parameters stay
        gathered from its forward to its backward) or ``"optim_grads_params"`` (ZeRO-3)."""
        if self.use_torch_fsdp2:
            return "optim_grads_params" if self.torch_fsdp2_reshard_after_forward else "optim_grads"
        if self.use_megatron_fsdp and self.data_parallel_sharding_strategy in (
            "optim_grads",
            "optim_grads_params",
        ):
            return self.data_parallel_sharding_strategy
        return None
