"""Megatron-Core's tensor-parallel helpers: splitting along the last dim, the vocabulary ranges of
the tp ranks, and a flat tensor split into (and gathered from) equal 1-D chunks across the tp group.
An omitted ``tp_group`` is the default ParallelState's tp group."""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.mappings import (
    ProcessGroup,
    _all_gather_single,
    default_tp_group,
    group_rank,
    group_size,
)


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by {d}")
    return n // d


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal blocks of the last dim (views, or contiguous copies with
    ``contiguous_split_chunks``).

    Raises:
        ValueError: the last dim is not divisible by ``num_partitions``.
    """
    size = _divide(tensor.shape[-1], num_partitions, "the last dimension")
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else tuple(chunks)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """This tp rank's block of ``tensor`` flattened into ``tp_size`` equal 1-D blocks: a view, or a new
    tensor with ``new_buffer``.

    Raises:
        ValueError: ``tensor.numel()`` is not divisible by the tp size.
    """
    group = default_tp_group(tp_group)
    n = group_size(group)
    part = _divide(tensor.numel(), n, "the number of elements")
    start = part * group_rank(group)
    data = tensor.reshape(-1)[start : start + part]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of :func:`split_tensor_into_1d_equal_chunks`: the tp ranks' 1-D blocks concatenated
    in rank order (a new tensor, no autograd)."""
    group = default_tp_group(tp_group)
    n = group_size(group)
    flat = tensor.detach().reshape(-1).contiguous()
    if n == 1:
        return flat.clone()
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather_single(out, flat, group=group)
    return out


class VocabUtility:
    """The vocabulary range ``[first, last)`` of tp rank ``rank`` of ``world_size``: contiguous
    equal blocks in rank order."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Raises ValueError when ``global_vocab_size`` is not divisible by ``world_size``."""
        per = _divide(global_vocab_size, world_size, "the vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per, rank, world_size)
