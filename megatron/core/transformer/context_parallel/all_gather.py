"""All-gather context-parallel attention (``cp_comm_type`` ``allgather``): every rank gathers the
whole sequence's keys and values, puts them in global order and attends its two query chunks to
the keys up to each chunk's end. Backward: dK/dV of every position are reduce-scattered back to
their owners (the all-gather's autograd)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from megatron.core.tensor_parallel.mappings import gather_from_sp, group_rank, group_size
from megatron.core.transformer.context_parallel.layout import chunk_ids
from megatron.core.transformer.context_parallel.ring import ring_attention


def chunk_order_index(from_ids: list[int], to_ids: list[int], chunk_len: int, device: Any) -> torch.Tensor:
    """Token indices that take a tensor whose chunks (of ``chunk_len`` tokens along dim 0) are in
    the order ``from_ids`` to the order ``to_ids``: ``x_to = x_from.index_select(0, index)``."""
    where = {c: i for i, c in enumerate(from_ids)}
    return torch.cat(
        [torch.arange(where[c] * chunk_len, (where[c] + 1) * chunk_len, device=device) for c in to_ids]
    )


def rank_order_ids(cp_size: int, ranks: range | list[int]) -> list[int]:
    """The chunk ids of ``ranks``' tokens laid one rank after another (each rank's two, in order)."""
    return [c for j in ranks for c in chunk_ids(cp_size, j)]


def all_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_mask: Any, scale: float, group: ProcessGroup
) -> torch.Tensor:
    """``q`` ``[s_l, b, n_q, d]``, ``k`` / ``v`` ``[s_l, b, n_kv, d]`` (this rank's two chunks) ->
    ``[s_l, b, n_q, d]``."""
    n, r = group_size(group), group_rank(group)
    s_l, d = q.shape[0], q.shape[-1]
    c = s_l // 2
    kv = gather_from_sp(torch.cat([k, v], dim=-1), group)  # [n * s_l, b, n_kv, 2d], rank order
    order = chunk_order_index(rank_order_ids(n, range(n)), list(range(2 * n)), c, q.device)
    k_all, v_all = kv.index_select(0, order).split(d, dim=-1)  # [S, b, n_kv, d], global order
    out = ring_attention(
        q.permute(1, 2, 0, 3),
        k_all.permute(1, 2, 0, 3),
        v_all.permute(1, 2, 0, 3),
        None,
        list(chunk_ids(n, r)),
        [list(range(2 * n))],
        c,
        doc_mask,
        scale,
    )
    return out.permute(2, 0, 1, 3)
