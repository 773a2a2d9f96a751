"""Autograd collectives across the tensor-parallel group.

The functions here take the group explicitly and are the identity when it has one rank (or is
``None``, no tensor parallelism); the library calls these. Megatron-Core's public names
(``copy_to_tensor_model_parallel_region(input_, group=None)``, ...), where an omitted group means the
default ParallelState's tp group, follow them at the end of this module. Shapes follow the
sequence-first convention ``[s, b, h]``: "sequence" collectives act on dim 0, the others on the
last dim. Slices are contiguous blocks in rank order: rank ``r`` of ``n`` holds block ``r``.

No collective modifies its input or the incoming gradient in place: autograd may hand the same
gradient tensor to several consumers (``a + b`` gives both operands the same one), so an in-place
all-reduce there would corrupt another branch's gradient.

Inside ``torch.compile`` the collectives are the functional ones (``_functional_collectives``),
which return new tensors and which the compiler orders with their waits itself; eager code uses the
c10d calls writing into preallocated outputs. Dynamo's rewriting of in-place c10d collectives into
functional ones has produced wrong results on CUDA (pytorch/pytorch#159350): our compiled tp2
layers did not train on two H200s with the in-place form, and do with the functional one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_init import get_parallel_state, model_parallel_is_initialized

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for ``None`` (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank within ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, n: int, dim: int) -> None:
    if x.shape[dim] % n != 0:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) is not divisible by the "
            f"tensor-parallel size {n}"
        )


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the group into a new tensor (``x`` is left untouched)."""
    if group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x.contiguous(), "sum", group)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _gather(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(x, 0, group)  # rank blocks stacked along dim 0
    else:
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def _split(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, n, dim)
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the group and keep this rank's block of dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, n, 0)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x, "sum", 0, group)
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(g, ctx.group, -1), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(g, ctx.group, -1), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(g, ctx.group, 0), None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the sequence dim. Backward: reduce-scatter (the consumer is tensor-parallel)
    or split (the consumer is replicated), chosen by ``reduce_grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _gather(x, group, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.reduce_grad:
            return _reduce_scatter(g, ctx.group), None, None
        return _split(g, ctx.group, 0), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(g, ctx.group, 0), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a tp region with a replicated input. Forward: identity. Backward: all-reduce."""
    return _CopyToRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum the ranks' partial results. Forward: all-reduce. Backward: identity."""
    return _ReduceFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's block of the last dim. Backward: all-gather the last dim."""
    return _ScatterToRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's block of the gradient."""
    return _GatherFromRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter the sequence-parallel region. Forward: keep this rank's block of dim 0.
    Backward: all-gather dim 0."""
    return _ScatterToSequence.apply(x, group) if group_size(group) > 1 else x


def gather_from_sp(
    x: torch.Tensor, group: ProcessGroup | None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Leave the sequence-parallel region. Forward: all-gather dim 0.

    Backward: reduce-scatter along dim 0 when the consumer is tensor-parallel (each rank holds a
    partial gradient, ``tensor_parallel_output_grad=True``), else keep this rank's block of dim 0
    (the consumer is replicated, every rank holds the full gradient).
    """
    return _GatherFromSequence.apply(x, group, tensor_parallel_output_grad) if group_size(group) > 1 else x


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum the ranks' partial results into sequence shards. Forward: reduce-scatter along dim 0.
    Backward: all-gather dim 0."""
    return _ReduceScatterToSequence.apply(x, group) if group_size(group) > 1 else x


# -- Megatron-Core's public names: an omitted group is the default ParallelState's tp group ------------


def default_tp_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, or when it is None the tp group of the default ParallelState (read only by the public
    entry points below; library code passes its group). Before ``initialize_model_parallel`` the
    default is a one-rank state: None, no tensor parallelism, and no group is created."""
    if group is not None:
        return group
    if not model_parallel_is_initialized():
        return None
    return get_parallel_state().tp_group


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Enter a tp region with a replicated input. Forward: identity. Backward: all-reduce over ``group``
    (default: the default tp group)."""
    return copy_to_tp(input_, default_tp_group(group))


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Sum the ranks' partial results. Forward: all-reduce over ``group`` (default: the default tp
    group). Backward: identity."""
    return reduce_from_tp(input_, default_tp_group(group))


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: keep this rank's block of the last dim. Backward: all-gather the last dim."""
    return scatter_to_tp(input_, default_tp_group(group))


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: all-gather the last dim in rank order. Backward: keep this rank's block."""
    return gather_from_tp(input_, default_tp_group(group))


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: keep this rank's block of dim 0. Backward: all-gather dim 0."""
    return scatter_to_sp(input_, default_tp_group(group))


def _check_no_split_sizes(name: str, value: object) -> None:
    if value is not None:
        raise ConfigError(
            f"{name}: uneven splits are not supported here; pass {name}=None (equal blocks)", params=(name,)
        )


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: ProcessGroup | None = None,
    output_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0 when ``tensor_parallel_output_grad``
    (the consumer is tensor-parallel), else keep this rank's block.

    ``use_global_buffer`` (Megatron's reusable output buffer) is accepted and has no effect: the
    output is always a new tensor. ``output_split_sizes`` must be None.
    """
    _check_no_split_sizes("output_split_sizes", output_split_sizes)
    return gather_from_sp(input_, default_tp_group(group), bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: ProcessGroup | None = None,
    input_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: reduce-scatter along dim 0. Backward: all-gather dim 0. ``input_split_sizes`` must be
    None; ``use_global_buffer`` has no effect."""
    _check_no_split_sizes("input_split_sizes", input_split_sizes)
    return reduce_scatter_to_sp(input_, default_tp_group(group))


class _AllGatherLastDim(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: reduce-scatter the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reduce_scatter_last_dim(g, ctx.group), None


class _ReduceScatterLastDim(torch.autograd.Function):
    """Forward: reduce-scatter the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(g, ctx.group, -1), None


def _reduce_scatter_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    _check_divisible(x, n, x.dim() - 1)
    moved = torch.stack(x.chunk(n, dim=-1))  # [n, ..., last/n]: rank blocks along dim 0
    return _reduce_scatter(moved, group).squeeze(0)


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: reduce-scatter the last dim (the gradient of every
    rank's copy is summed)."""
    group = default_tp_group(group)
    return _AllGatherLastDim.apply(input_, group) if group_size(group) > 1 else input_


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Forward: sum over the group and keep this rank's block of the last dim. Backward: all-gather
    the last dim."""
    group = default_tp_group(group)
    return _ReduceScatterLastDim.apply(input_, group) if group_size(group) > 1 else input_


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all of dim 0 blocks. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any,
        group: ProcessGroup,
        x: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
    ) -> torch.Tensor:
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        x = x.contiguous()
        if output_split_sizes is None:
            out = torch.empty_like(x)
        else:
            out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(
            out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group
        )
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_sizes, in_sizes = ctx.splits
        return None, _AllToAll.apply(ctx.group, g, in_sizes, out_sizes), None, None


def all_to_all(
    group: ProcessGroup,
    input_: torch.Tensor,
    output_split_sizes_: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    use_nccl_stream: bool = False,
) -> torch.Tensor:
    """All-to-all along dim 0 over ``group`` (required, as in Megatron-Core): block ``j`` of this
    rank's input goes to rank ``j``; blocks are equal unless split sizes are given. Backward: the
    reverse exchange. ``use_nccl_stream`` has no effect.

    Raises:
        ValueError: ``group`` is None.
    """
    if group is None:
        raise ValueError("all_to_all needs its group: pass group=<a process group> (e.g. the tp group)")
    if group_size(group) == 1:
        return input_
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``[num_tokens/tp, H]`` (tokens sharded) -> ``[num_tokens, H/tp]`` (hidden sharded) over ``group``
    (default: the default tp group): rank ``r`` receives every rank's tokens, hidden block ``r``."""
    group = default_tp_group(group)
    n = group_size(group)
    x = input_.reshape(-1, input_.shape[-1])
    if n == 1:
        return x
    assert group is not None
    _check_divisible(x, n, 1)
    return all_to_all(group, torch.cat(x.split(x.shape[-1] // n, dim=1), dim=0))


def all_to_all_hp2sp(input_: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of :func:`all_to_all_sp2hp`: ``[num_tokens, H/tp]`` -> ``[num_tokens/tp, H]``."""
    group = default_tp_group(group)
    n = group_size(group)
    x = input_.reshape(-1, input_.shape[-1])
    if n == 1:
        return x
    assert group is not None
    _check_divisible(x, n, 0)
    exchanged = all_to_all(group, x)
    return torch.cat(exchanged.split(exchanged.shape[0] // n, dim=0), dim=-1)
