"""All-to-all context-parallel attention: ``a2a`` (Ulysses) and the hierarchical ``a2a+p2p``.

``a2a``: an all-to-all over the cp group trades the sequence split for a head split (each rank then
holds the whole sequence for ``n / cp`` heads, ``n_kv / cp`` key/value heads), the sequence is put in
global order, plain causal (or document-masked) attention runs, and the reverse all-to-all brings
this rank's tokens back with every head.

``a2a+p2p``: the all-to-all runs inside level 0 (``a`` consecutive cp ranks), giving each rank the
chunks of its level-0 group for ``n / a`` heads; ring attention (:mod:`ring`) runs across level 1
on those chunks; the reverse all-to-all follows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megatron.core.tensor_parallel.mappings import all_to_all, group_rank, group_size
from megatron.core.transformer.context_parallel.all_gather import chunk_order_index, rank_order_ids
from megatron.core.transformer.context_parallel.ring import ring_attention


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``[s_l, b, n, d]`` (this rank's tokens, every head) -> ``[g * s_l, b, n / g, d]`` (the group's
    tokens, rank after rank, for this rank's block of heads); ``g`` the group size. Backward: the
    reverse all-to-all."""
    g = group_size(group)
    s_l, b, n, d = x.shape
    x = x.reshape(s_l, b, g, n // g, d).permute(2, 0, 1, 3, 4).reshape(g * s_l, b, n // g, d)
    return all_to_all(group, x)


def heads_to_seq(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[g * s_l, b, n / g, d]`` -> ``[s_l, b, n, d]``."""
    g = group_size(group)
    s, b, n_g, d = y.shape
    y = all_to_all(group, y.contiguous())  # block j: this rank's tokens, head block j
    return y.reshape(g, s // g, b, n_g, d).permute(1, 2, 0, 3, 4).reshape(s // g, b, g * n_g, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_mask: Any,
    group: ProcessGroup,
    local_attention: nn.Module,
) -> torch.Tensor:
    """``a2a``: ``q`` ``[s_l, b, n_q, d]``, ``k`` / ``v`` ``[s_l, b, n_kv, d]`` -> ``[s_l, b, n_q, d]``.
    ``local_attention`` is a core attention without context parallelism (``[S, b, n, d]`` inputs,
    ``[S, b, n * d]`` output, ``attention_mask`` None or a DocumentMask)."""
    n = group_size(group)
    c = q.shape[0] // 2
    to_global = chunk_order_index(rank_order_ids(n, range(n)), list(range(2 * n)), c, q.device)
    back = torch.argsort(to_global)
    q_h, k_h, v_h = (seq_to_heads(t, group).index_select(0, to_global) for t in (q, k, v))
    out = local_attention(q_h, k_h, v_h, doc_mask)  # [S, b, n_q / n * d]
    out = out.view(q_h.shape).index_select(0, back)
    return heads_to_seq(out, group)


def hierarchical_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_mask: Any,
    scale: float,
    cp_size: int,
    a2a_group: ProcessGroup,
    ring_group: ProcessGroup,
) -> torch.Tensor:
    """``a2a+p2p``: shapes as :func:`ulysses_attention`. cp rank = level-0 rank + a * level-1 rank."""
    a, r = group_size(a2a_group), group_size(ring_group)
    c = q.shape[0] // 2

    def ids_of(ring_rank: int) -> list[int]:
        return sorted(rank_order_ids(cp_size, range(ring_rank * a, (ring_rank + 1) * a)))

    me = group_rank(ring_group)
    received = rank_order_ids(cp_size, range(me * a, (me + 1) * a))
    to_sorted = chunk_order_index(received, ids_of(me), c, q.device)
    back = torch.argsort(to_sorted)
    q_h, k_h, v_h = (seq_to_heads(t, a2a_group).index_select(0, to_sorted) for t in (q, k, v))
    out = ring_attention(
        q_h.permute(1, 2, 0, 3),
        k_h.permute(1, 2, 0, 3),
        v_h.permute(1, 2, 0, 3),
        ring_group,
        ids_of(me),
        [ids_of(j) for j in range(r)],
        c,
        doc_mask,
        scale,
    )
    return heads_to_seq(out.permute(2, 0, 1, 3).index_select(0, back), a2a_group)
