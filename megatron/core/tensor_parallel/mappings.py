"""Autograd collectives across the tensor-parallel group.

Each function is the identity when the group has one rank (or is ``None``). Shapes follow the
sequence-first convention ``[s, b, h]``: "sequence" collectives act on dim 0, the others on the
last dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if dim == 0:
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if group_size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, -1), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, 0), None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the sequence dim. Backward: reduce-scatter (the consumer is tensor-parallel)
    or split (the consumer is replicated), chosen by ``reduce_grad``."""

    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _gather(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return _reduce_scatter(g, ctx.group), None, None
        return _split(g, ctx.group, 0), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, 0), None


def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequence.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad: bool = True):
    return _GatherFromSequence.apply(x, group, tensor_parallel_output_grad) if group_size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequence.apply(x, group) if group_size(group) > 1 else x
