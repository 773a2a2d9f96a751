"""DistributedDataParallelConfig: how gradients are buffered and reduced across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import doc


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = doc(
        True, "Accumulate and reduce gradients in fp32 main-grad buffers (bf16/fp16 params).", flag=None
    )
    overlap_grad_reduce: bool = doc(False, "Reduce gradient buckets during backward as they become ready.")
    use_distributed_optimizer: bool = doc(
        False,
        "Shard the optimizer across data-parallel ranks (ZeRO-1): each parameter's fp32 main copy and Adam "
        "moments live on one rank, which receives its reduced gradient, updates it and broadcasts the "
        "new weights. Optimizer memory per GPU drops about DP-fold; checkpoints keep the same layout.",
    )
    overlap_param_gather: bool = doc(
        False,
        "With --use-distributed-optimizer: the broadcasts of the updated weights run during the next "
        "forward pass instead of after the step; each layer waits only for its own weights. Needs "
        "--overlap-grad-reduce.",
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
