"""Packed sequences: documents laid end to end in one sequence attend only within themselves
(block-diagonal causal masking, Megatron's ``--reset-attention-mask``), described by each token's
document index instead of a dense ``[s, s]`` mask.

A ``DocumentMask`` travels through the model where an attention mask does (``GPTModel.forward``'s
``attention_mask``); the attention kernels turn it into variable-length attention (GPU) or a mask of
the block they compute (CPU, and the context-parallel blocks). With context parallelism it keeps the
document ids of the *full* sequence, so every cp rank can mask any block of queries against any block
of keys by their global positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DocumentMask:
    """``doc_ids`` ``[b, S]`` int: the document index of each token of the full sequence (non-decreasing
    along the sequence). Query ``i`` sees key ``j`` when ``j <= i`` and both are in the same document.

    What the kernels derive from the ids (the dense mask, the variable-length boundaries) is computed
    on first use and cached on the instance: one ``DocumentMask`` per micro-batch serves every layer.
    Finding the boundaries (:meth:`varlen`) copies them to the host, one device -> host sync per
    micro-batch, not per layer; :meth:`from_cu_seqlens` with ``max_seqlen`` avoids even that one.
    """

    doc_ids: torch.Tensor
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod: int) -> DocumentMask:
        """The documents of ``tokens`` ``[b, S]``: a new document starts after each end-of-document
        token (the EOD belongs to the document it ends), as GPTDataset's --reset-attention-mask."""
        ends = (tokens == eod).to(torch.int32)
        doc_ids = torch.zeros_like(ends)
        doc_ids[:, 1:] = torch.cumsum(ends[:, :-1], dim=1)
        return cls(doc_ids)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor,
        seq_length: int,
        batch_size: int = 1,
        max_seqlen: int | None = None,
    ) -> DocumentMask:
        """Megatron-Core's packed-sequence description (``PackedSeqParams.cu_seqlens_q``, THD layout):
        ``cu_seqlens`` ``[num_docs + 1]`` int, the start offset of each document in the
        ``batch_size * seq_length`` tokens taken as one row after another, ending with their total.
        Each row's first token must start a document (documents do not span rows). ``max_seqlen``
        (``PackedSeqParams.max_seqlen_q``), when given, spares :meth:`varlen` its host sync."""
        total = batch_size * seq_length
        position = torch.arange(total, device=cu_seqlens.device)
        doc_ids = torch.searchsorted(cu_seqlens[1:].to(torch.int64), position, right=True)
        mask = cls(doc_ids.to(torch.int32).view(batch_size, seq_length))
        if max_seqlen is not None:
            mask._cache["varlen"] = (cu_seqlens.to(torch.int32), int(max_seqlen))
        return mask

    @property
    def seq_length(self) -> int:
        return self.doc_ids.shape[1]

    def block_mask(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """``[b, 1, len(q_index), len(k_index)]`` bool, True = masked, for the queries and keys at the
        global positions ``q_index`` / ``k_index`` (1-D int64 tensors)."""
        q_doc = self.doc_ids[:, q_index]  # [b, sq]
        k_doc = self.doc_ids[:, k_index]  # [b, sk]
        later = k_index[None, :] > q_index[:, None]  # [sq, sk]
        other = q_doc[:, :, None] != k_doc[:, None, :]  # [b, sq, sk]
        return (later[None] | other).unsqueeze(1)

    def dense(self) -> torch.Tensor:
        """The whole ``[b, 1, S, S]`` mask (True = masked): GPTDataset's --reset-attention-mask mask.
        Cached (read-only)."""
        if "dense" not in self._cache:
            index = torch.arange(self.seq_length, device=self.doc_ids.device)
            self._cache["dense"] = self.block_mask(index, index)
        dense: torch.Tensor = self._cache["dense"]
        return dense

    def varlen(self) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens [num_docs + 1] int32, max_seqlen)`` over the ``b * S`` tokens taken row after
        row (every row starts a new document): the variable-length kernels' description. Cached; the
        first call waits for the boundaries on the host (see the class docstring)."""
        if "varlen" not in self._cache:
            b, s = self.doc_ids.shape
            starts = torch.ones_like(self.doc_ids, dtype=torch.bool)  # [b, S]: a document starts here
            starts[:, 1:] = self.doc_ids[:, 1:] != self.doc_ids[:, :-1]
            offsets = torch.nonzero(starts.flatten()).flatten()  # the host sync
            end = torch.tensor([b * s], device=offsets.device, dtype=offsets.dtype)
            cu_seqlens = torch.cat([offsets, end]).to(torch.int32)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            self._cache["varlen"] = (cu_seqlens, max_seqlen)
        varlen: tuple[torch.Tensor, int] = self._cache["varlen"]
        return varlen


def varlen_supported(q: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether :func:`varlen_attention` takes ``q`` (``[.., d]``): CUDA, fp16/bf16, a head size the
    flash kernel has (a multiple of 8, at most 256) and flash attention available."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.backends.cuda.is_flash_attention_available()
    )


class _VarlenFlash(torch.autograd.Function):
    """Causal flash attention over packed documents: ``q`` ``[T, n_q, d]``, ``k``/``v`` ``[T, n_kv, d]``
    (the kernel reads GQA itself and reduces dK/dV over each group) -> ``[T, n_q, d]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        dropout_p: float,
        scale: float,
    ) -> torch.Tensor:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.dropout_p, ctx.scale = max_seqlen, dropout_p, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        s = ctx.max_seqlen
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, s, s,
            ctx.dropout_p, True, rng_state, unused, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-diagonal causal attention of packed documents by variable-length flash attention (no
    ``[S, S]`` mask): ``q`` ``[b, n_q, S, d]``, ``k``/``v`` ``[b, n_kv, S, d]`` -> ``[b, n_q, S, d]``.
    Needs :func:`varlen_supported`. Never traced by ``torch.compile``: a compiled layer breaks its graph
    here, so the documents' boundaries (a host sync, cached on the mask) and their longest length (an
    int the kernel takes) change from step to step without recompiling the layer."""
    b, n_q, s, d = q.shape
    cu_seqlens, max_seqlen = mask.varlen()
    packed = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [b*S, n, d]
    scale = d**-0.5 if scale is None else scale
    out = _VarlenFlash.apply(*packed, cu_seqlens, max_seqlen, dropout_p, scale)
    return out.view(b, s, n_q, d).transpose(1, 2)
