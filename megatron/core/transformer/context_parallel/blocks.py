"""Which query chunks attend which key chunks, decided by their global chunk ids, and one key/value
block's forward and backward share of the attention of a set of local query chunks.

Every context-parallel comm type reduces to this: a rank holds query chunks with known global ids
(``q_ids``) and, one block at a time, key/value chunks with known ids (``kv_ids``); all chunks are
``chunk_len`` tokens. Query chunk ``a`` sees key chunk ``c`` fully when ``c < a``, causally when
``c == a`` and not at all when ``c > a`` (the sequence is causal). With a
:class:`~megatron.core.transformer.document_mask.DocumentMask` each computed sub-block also gets its
document mask, from the chunks' global positions.

Tensors are in the kernels' layout: ``q`` ``[b, n_q, len(q_ids) * chunk_len, d]``, ``k`` / ``v``
``[b, n_kv, len(kv_ids) * chunk_len, d]``, chunks in the order of the id lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.transformer.context_parallel import kernels


@dataclass(frozen=True)
class SubBlock:
    """Query chunks ``q_lo:q_hi`` against key chunks ``k_lo:k_hi`` (indices into the id lists):
    ``causal`` for a chunk against itself (one chunk each side), else every query sees every key."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def block_plan(q_ids: list[int], kv_ids: list[int]) -> list[SubBlock]:
    """The sub-blocks that cover every visible (query chunk, key chunk) pair exactly once, as few as
    the id orders allow: runs of consecutive fully-visible key chunks form one sub-block, and query
    chunks with the same run are merged."""
    plan: list[SubBlock] = []
    open_runs: dict[tuple[int, int], int] = {}  # key run -> index in plan of the block ending at qi
    for qi, a in enumerate(q_ids):
        runs, lo = [], None
        for ki, c in enumerate([*kv_ids, None]):
            full = c is not None and c < a
            if full and lo is None:
                lo = ki
            if not full and lo is not None:
                runs.append((lo, ki))
                lo = None
        next_open: dict[tuple[int, int], int] = {}
        for run in runs:
            j = open_runs.get(run)
            if j is not None:
                b = plan[j]
                plan[j] = SubBlock(b.q_lo, qi + 1, b.k_lo, b.k_hi, False)
            else:
                j = len(plan)
                plan.append(SubBlock(qi, qi + 1, run[0], run[1], False))
            next_open[run] = j
        open_runs = next_open
        for ki, c in enumerate(kv_ids):
            if c == a:
                plan.append(SubBlock(qi, qi + 1, ki, ki + 1, True))
    return plan


def _positions(ids: list[int], chunk_len: int, device: torch.device) -> torch.Tensor:
    """The global token positions of the chunks ``ids``, in order."""
    if not ids:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in ids])


def _mask(
    blk: SubBlock, q_ids: list[int], kv_ids: list[int], chunk_len: int, doc_mask: Any, device: torch.device
) -> kernels.Mask:
    if doc_mask is None:
        return "causal" if blk.causal else None
    q_pos = _positions(q_ids[blk.q_lo : blk.q_hi], chunk_len, device)
    k_pos = _positions(kv_ids[blk.k_lo : blk.k_hi], chunk_len, device)
    mask: torch.Tensor = doc_mask.block_mask(q_pos, k_pos)
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ids: list[int],
    kv_ids: list[int],
    chunk_len: int,
    doc_mask: Any,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge this key/value block's attention into ``out`` (``[b, n_q, sq, d]``, accumulation dtype)
    and ``lse`` (``[b, n_q, sq]``, -inf where nothing was seen yet), in place (see :func:`empty_result`)."""
    c = chunk_len
    for blk in block_plan(q_ids, kv_ids):
        qs, ks = slice(blk.q_lo * c, blk.q_hi * c), slice(blk.k_lo * c, blk.k_hi * c)
        mask = _mask(blk, q_ids, kv_ids, c, doc_mask, q.device)
        b_out, b_lse = kernels.block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, scale)
        out[:, :, qs], lse[:, :, qs] = kernels.merge(out[:, :, qs], lse[:, :, qs], b_out, b_lse)


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ids: list[int],
    kv_ids: list[int],
    chunk_len: int,
    doc_mask: Any,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add this key/value block's share of the gradients to ``dq`` (all local queries) and ``dk`` /
    ``dv`` (this block's keys and values), in place; ``out`` / ``lse`` are the merged results."""
    c = chunk_len
    for blk in block_plan(q_ids, kv_ids):
        qs, ks = slice(blk.q_lo * c, blk.q_hi * c), slice(blk.k_lo * c, blk.k_hi * c)
        mask = _mask(blk, q_ids, kv_ids, c, doc_mask, q.device)
        g_q, g_k, g_v = kernels.block_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs], mask, scale
        )
        dq[:, :, qs] += g_q
        dk[:, :, ks] += g_k
        dv[:, :, ks] += g_v


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out zeros, lse -inf) for the rows of ``q``, both in the accumulation dtype (fp32; fp64 for
    fp64 inputs)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    return out, lse
