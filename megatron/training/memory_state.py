"""Weights, gradient memory and optimizer state of one model chunk on one rank (see memory_estimate)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.distributed.distributed_data_parallel import bucket_lengths, bucket_size
from megatron.core.distributed.param_and_grad_buffer import bucket_layout
from megatron.core.optimizer.cpu_offload import MAX_CHUNK_NUMEL
from megatron.training.memory_activations import Kernels, dtype_bytes, layers_fp8
from megatron.training.memory_params import ParamInfo


def _cut(numels: list[int], limit: int) -> list[list[int]]:
    """DDP's buckets (``bucket_lengths``): consecutive params until a bucket reaches ``limit`` elements."""
    groups, start = [], 0
    for length in bucket_lengths(numels, limit):
        groups.append(numels[start : start + length])
        start += length
    return groups


def _is_tied(info: ParamInfo, cfg) -> bool:
    m = cfg.model
    return (
        m.share_embeddings_and_output_weights
        and m.pipeline_model_parallel_size > 1
        and (info.tied_copy or info.name.endswith("word_embeddings.weight"))
    )


def ddp_gradient_bytes(cfg, params: list[ParamInfo], dp: int) -> tuple[float, float, int]:
    """(after the first backward of a step, after later ones, elements kept as single gradients in the
    param dtype) of one chunk's ``DistributedDataParallel`` (see the module docstring)."""
    p, g = (
        dtype_bytes(cfg.model.params_dtype),
        4 if cfg.ddp.grad_reduce_in_fp32 else dtype_bytes(cfg.model.params_dtype),
    )
    ordered = list(reversed(params))

    def aliasable(info: ParamInfo) -> bool:
        return (
            cfg.ddp.alias_single_gradients
            and not info.sp_tagged
            and not _is_tied(info, cfg)
            and (dp == 1 or p == g)
        )

    limit = bucket_size(cfg.ddp, dp)
    if dp > 1 and any(aliasable(i) for i in ordered):
        groups = [[i for i in ordered if aliasable(i)], [i for i in ordered if not aliasable(i)]]
    else:
        groups = [ordered]
    first = more = 0.0
    single = 0
    for group in groups:
        start = 0
        for bucket in _cut([i.numel for i in group], limit):
            members = group[start : start + len(bucket)]
            start += len(bucket)
            numel = sum(bucket)
            aliased = sum(i.numel for i in members if aliasable(i))
            single += aliased
            first += aliased * p + (numel * g if aliased < numel else 0)
            more += numel * g
    return first, more, single


def padded_buckets(cfg, params: list[ParamInfo], dp: int) -> list[int]:
    """The distributed optimizer's buckets: each param's start aligned to 64 elements, each bucket
    padded to a multiple of lcm(dp, 128); the tied embedding in a bucket of its own."""
    tied = [i for i in params if _is_tied(i, cfg)]
    rest = [i for i in reversed(params) if not _is_tied(i, cfg)]
    sizes = []
    for group in ([rest] if rest else []) + [[i] for i in tied]:
        for bucket in _cut([i.numel for i in group], bucket_size(cfg.ddp, dp)):
            sizes.append(bucket_layout(bucket, dp)[1])
    return sizes


def _optimizer_bytes_per_element(cfg) -> tuple[int, int]:
    """(fp32 main copy, moments) bytes per optimized element."""
    main = 0 if cfg.model.params_dtype == torch.float32 else 4
    return main, 8 if cfg.optimizer.optimizer == "adam" else 4


def _offload_fraction(cfg) -> float:
    o = cfg.optimizer
    return float(o.optimizer_offload_fraction) if o.optimizer_cpu_offload else 0.0


def offload_host_bytes(elements: float, moments: int, staged: int) -> float:
    """Host memory of ``--optimizer-cpu-offload`` (``core.optimizer.cpu_offload``) for ``elements``
    offloaded: fp32 main params and moments, plus two staging slots each way of one chunk (at most
    2^26 elements, about a quarter of the offloaded ones) at ``staged`` bytes per element."""
    if elements <= 0:
        return 0.0
    chunk = min(float(MAX_CHUNK_NUMEL), elements / 4)
    return elements * (4 + moments) + 2 * chunk * staged


@dataclass
class StaticTerms:
    weights: float = 0.0
    gradients_first: float = 0.0
    gradients_more: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0
    gathered: float = 0.0  # FSDP2: unsharded parameters held (root; every layer with optim_grads)
    gathered_in_flight: float = 0.0  # FSDP2: one layer and the prefetched next (optim_grads_params)
    backward_extra: float = 0.0  # FSDP2: a layer's unsharded gradients before their reduce-scatter
    single_grads: int = 0


def chunk_static(cfg, chunk, dp: int, microbatches: int, expt_dp: int | None = None) -> StaticTerms:
    """Weights, gradient memory and optimizer state of one chunk on one rank; the distributed optimizer
    shards dense parameters over ``dp`` (dp x cp) and expert parameters over ``expt_dp`` (default dp)."""
    p = dtype_bytes(cfg.model.params_dtype)
    main, moments = _optimizer_bytes_per_element(cfg)
    f = _offload_fraction(cfg)
    staged = (4 if cfg.ddp.grad_reduce_in_fp32 else p) + p  # a gradient and a param slot per element
    out = StaticTerms()
    elements = sum(i.numel for i in chunk.params)
    sharding = cfg.ddp.fsdp_sharding()
    if sharding is not None:
        shard = sum(-(-i.rows // dp) * (i.numel // max(i.rows, 1)) for i in chunk.params)
        out.weights = shard * 4.0  # fp32 shards, the optimizer's main params
        out.gradients_first = out.gradients_more = shard * 4.0 + (elements * 4.0 if microbatches > 1 else 0.0)
        out.optimizer = shard * moments * (1 - f)
        out.host = offload_host_bytes(shard * f, moments, 4 + p)
        layers = [sum(i.numel for i in layer) for layer in chunk.layers]
        root = elements - sum(layers)
        out.gathered = root * p + (sum(layers) * p if sharding == "optim_grads" else 0.0)
        out.gathered_in_flight = 0.0 if sharding == "optim_grads" else 2.0 * max(layers, default=0) * p
        out.backward_extra = max(layers, default=0) * (p + 4.0)
        return out
    expt_dp = dp if expt_dp is None else expt_dp
    if cfg.ddp.use_distributed_optimizer and (dp > 1 or expt_dp > 1):
        dense = [i for i in chunk.params if not i.expert]
        experts = [i for i in chunk.params if i.expert]
        dense_padded = sum(padded_buckets(cfg, dense, dp)) if dense else 0
        expert_padded = sum(padded_buckets(cfg, experts, expt_dp)) if experts else 0
        padded = dense_padded + expert_padded
        g = 4 if cfg.ddp.grad_reduce_in_fp32 else p
        out.weights = padded * p
        out.gradients_first = out.gradients_more = padded * g
        owned = dense_padded / dp + expert_padded / expt_dp
        out.optimizer = owned * (main + moments) * (1 - f)
        out.host = offload_host_bytes(owned * f, moments, staged)
        return out
    out.weights = elements * p
    out.gradients_first, out.gradients_more, out.single_grads = ddp_gradient_bytes(cfg, chunk.params, dp)
    out.optimizer = elements * (main * (1 - f) + moments * (1 - f))
    # Single gradients of one micro-batch travel in the param dtype, bucketed ones in the bucket's.
    single = microbatches == 1 and out.single_grads == elements
    out.host = offload_host_bytes(elements * f, moments, 2 * p if single else staged)
    return out


def fp8_state_bytes(cfg, kernels: Kernels, chunk) -> float:
    """The FP8 linears' scaling state: a [3, history] fp32 amax history and flags per linear."""
    if kernels.fp8 is None:
        return 0.0
    length = cfg.model.fp8_amax_history_len if kernels.fp8.recipe.recipe == "delayed" else 1
    linears = sum(len(x) for x in layers_fp8(kernels, chunk.offset, chunk.num_layers))
    return linears * (3 * length * 4 + 3 + 12)
