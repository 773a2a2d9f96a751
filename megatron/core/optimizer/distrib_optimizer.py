"""DistributedOptimizer: optimizer state sharded element-wise over the data-parallel ranks (ZeRO-1).

Megatron's layout (``megatron.core.distributed.param_and_grad_buffer``): data-parallel rank ``r``
owns the slice ``[r * len / dp, (r + 1) * len / dp)`` of every gradient bucket. The optimizer sees
one 1-D *piece* per (param, owned range): the piece's view of the parameter buffer is its model
param, an fp32 copy (bf16/fp16 params) its main param, and its slice of ``param.main_grad`` (the
reduce-scattered bucket) its gradient, so weight decay and ``--decoupled-lr`` still apply per param
group. Everything else is :class:`MegatronOptimizer`'s step: the one-pass AdamW writes the updated
piece into the parameter buffer, then one all-gather per bucket (:class:`ParamGather`) refreshes
every replica's params. Grad norm, zero count and the found-inf flag are summed over the whole
world: each element is owned once, tensor-parallel replicated params count on tp rank 0 only and
the last stage's copy of a tied embedding not at all. Expert parameters' buckets are sharded over
expert-dp (their own group), so each of their elements is owned once too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import ParamGather, Piece
from megatron.core.optimizer.clip_grads import counts_in_stats
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig


class DistributedOptimizer(MegatronOptimizer):
    """A MegatronOptimizer over this data-parallel rank's pieces of the DDP chunks' buckets.

    Args:
        config: optimizer settings.
        param_groups: :func:`get_param_groups`' groups of whole model params; each becomes the group
            of this rank's pieces of its params (maybe empty: every rank keeps every group, so all
            describe the same groups in checkpoints).
        grad_scaler: loss scaler (fp16), or None.
        model_chunks: the DDP wrappers built with ``use_distributed_optimizer`` (their
            ``param_buffers`` hold the layout).
        tp_rank: this rank's tensor-parallel rank, for :func:`param_is_not_duplicate`.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        param_groups: list[dict[str, Any]],
        grad_scaler: MegatronGradScaler | None,
        model_chunks: list[DistributedDataParallel],
        tp_rank: int = 0,
    ) -> None:
        # Forward order (a chunk's buckets are laid out backward), so overlapped gathers arrive in use order.
        buffers = [b for chunk in model_chunks for b in reversed(chunk.param_buffers)]
        piece_of = {id(piece.param): piece for b in buffers for piece in b.pieces}
        groups = [
            dict(g, params=[piece_of[id(p)].data for p in g["params"] if id(p) in piece_of])
            for g in param_groups
        ]
        dp_group = model_chunks[0].dp_group  # (each buffer gathers over its own group)
        overlap = model_chunks[0].ddp_config.overlap_param_gather
        sync = ParamGather(buffers, dp_group, overlap=overlap)
        if overlap:
            sync.attach(list(model_chunks))
        super().__init__(config, groups, grad_scaler, dist.group.WORLD, tp_rank, param_sync=sync)
        if buffers:  # (a rank may own padding only: its statistics still live on the model's device)
            self.device = buffers[0].data.device
        by_data = {id(piece.data): piece for piece in piece_of.values()}
        self.pieces: list[Piece] = [by_data[id(t)] for t in self.model_params]
        self._counts_in_stats = [counts_in_stats(pc.param, tp_rank) for pc in self.pieces]

    def _model_grads(self) -> list[torch.Tensor | None]:
        """Each piece's slice of its param's reduce-scattered ``main_grad``."""
        return [piece.grad() for piece in self.pieces]


def state_bytes_per_element(config: OptimizerConfig, param_dtype: torch.dtype) -> int:
    """Optimizer-state bytes per optimized element: the fp32 main copy (bf16/fp16 params) and the
    moments (Adam: two fp32; SGD: one with momentum)."""
    main = 4 if param_dtype != torch.float32 else 0
    if config.optimizer == "adam":
        return main + 8
    return main + (4 if config.sgd_momentum else 0)


def memory_report(optimizer: MegatronOptimizer, model_chunks: list[DistributedDataParallel]) -> str:
    """One line: this rank's optimizer-state bytes against what the plain optimizer would hold."""
    config = optimizer.config
    mine = sum(t.numel() * state_bytes_per_element(config, t.dtype) for t in optimizer.model_params)
    params = {id(p): p for c in model_chunks for p in c.module.parameters() if p.requires_grad}
    plain = sum(p.numel() * state_bytes_per_element(config, p.dtype) for p in params.values())
    dp = model_chunks[0].dp_size
    owned = sum(b.numel // b.domain.size for c in model_chunks for b in c.buckets)
    experts = (
        f" (1/{model_chunks[0].expt_dp_size} of the expert ones)" if model_chunks[0].has_expert_params else ""
    )
    return (
        f" > distributed optimizer: this rank owns 1/{dp} of every gradient bucket{experts} ({owned} elements, "
        f"padding included) and holds {mine / 2**20:.2f} MiB of optimizer state (fp32 main params and "
        f"moments); the plain optimizer would hold {plain / 2**20:.2f} MiB"
    )
