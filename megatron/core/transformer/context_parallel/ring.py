"""Ring attention (``cp_comm_type`` ``p2p``): keys and values travel around the cp ranks while each
rank attends its own queries to the block it holds.

Forward, ``R`` steps: at step ``i`` rank ``r`` holds the key/value block of ring rank
``(r - i) mod R`` and attends it (the sub-blocks of :func:`blocks.block_plan`) while the block moves
one hop on (send to ``r + 1``, receive from ``r - 1``, asynchronously). Partial results are merged
with the log-sum-exp. Only the local q, k, v and the merged output and log-sum-exp are saved.

Backward: the key/value blocks circulate again, and with each travels its dK/dV accumulator: every
rank adds its share for the block it holds and passes both on (the accumulator's hop overlaps the
next block's compute: the share is computed first, the arriving accumulator added after); after
``R`` hops each accumulator is back at the block's owner. dQ stays local.

With the zigzag split (rank ``j`` holds chunks ``j`` and ``2R - 1 - j``) every step costs the same:
step 0 is causal over the local two chunks; a block from ``j < r`` is seen by all local queries
through its first chunk; a block from ``j > r`` is seen whole by the local second chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.core.transformer.context_parallel import blocks


def _shift(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``x`` to the next ring rank and receiving the previous one's into a new buffer.
    Returns (the buffer, the requests to wait on before reading it)."""
    n, r = group_size(group), group_rank(group)
    recv = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (r + 1) % n), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(pending: tuple[torch.Tensor, list[Any]]) -> torch.Tensor:
    recv, works = pending
    for w in works:
        w.wait()
    return recv


class RingAttention(torch.autograd.Function):
    """Forward: the attention of the local queries over every ring rank's keys and values (the block
    moves one hop per step, overlapped with the step's compute). Backward: the blocks circulate again
    with their dK/dV accumulators, which end at their owners.

    Args (forward): ``q`` ``[b, n_q, sq, d]``, ``k`` / ``v`` ``[b, n_kv, skv, d]`` this rank's block;
    ``group`` the ring (None: no ring, the one block is all keys); ``q_ids`` the local queries'
    global chunk ids; ``kv_ids_of[j]`` the chunk ids of ring rank ``j``'s block; ``chunk_len`` tokens
    per chunk; ``doc_mask`` None or a DocumentMask of the full sequence; ``scale`` the softmax scale.
    Returns ``[b, n_q, sq, d]`` in q's dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup | None,
        q_ids: list[int],
        kv_ids_of: list[list[int]],
        chunk_len: int,
        doc_mask: Any,
        scale: float,
    ) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        assert len(kv_ids_of) == n, "one chunk-id list per ring rank"
        kv = torch.stack([k, v])  # [2, b, n_kv, skv, d]: one message per hop
        out, lse = blocks.empty_result(q)
        for i in range(n):
            pending = _shift(kv, group) if group is not None and i < n - 1 else None
            ids = kv_ids_of[(r - i) % n]
            blocks.attend(q, kv[0], kv[1], q_ids, ids, chunk_len, doc_mask, scale, out, lse)
            if pending is not None:
                kv = _wait(pending)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.args = (group, q_ids, kv_ids_of, chunk_len, doc_mask, scale)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, q_ids, kv_ids_of, chunk_len, doc_mask, scale = ctx.args
        n, r = group_size(group), group_rank(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dout = dout.contiguous()
        dkv: torch.Tensor | None = None
        incoming = None  # the dK/dV accumulator of the block held next, on its way from the previous rank
        for i in range(n):
            pending = _shift(kv, group) if group is not None and i < n - 1 else None
            ids = kv_ids_of[(r - i) % n]
            share = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            blocks.attend_backward(
                dout,
                q,
                kv[0],
                kv[1],
                out,
                lse,
                q_ids,
                ids,
                chunk_len,
                doc_mask,
                scale,
                dq,
                share[0],
                share[1],
            )
            dkv = share if incoming is None else _wait(incoming).add_(share)
            if group is not None:
                incoming = _shift(dkv, group)  # overlaps the next block's compute
            if pending is not None:
                kv = _wait(pending)
        if incoming is not None:
            dkv = _wait(incoming)  # after n hops: this rank's own block's accumulator
        assert dkv is not None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup | None,
    q_ids: list[int],
    kv_ids_of: list[list[int]],
    chunk_len: int,
    doc_mask: Any,
    scale: float,
) -> torch.Tensor:
    """:class:`RingAttention` (see there for the arguments)."""
    out: torch.Tensor = RingAttention.apply(q, k, v, group, q_ids, kv_ids_of, chunk_len, doc_mask, scale)
    return out
