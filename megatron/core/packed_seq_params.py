"""Megatron-Core's description of packed variable-length sequences (``PackedSeqParams``).

Megatron-Core hands these to Transformer Engine's attention as the ``thd`` format. Here
``GPTModel.forward(packed_seq_params=...)`` turns a ``thd`` description into a ``DocumentMask``
(block-diagonal causal attention, ``megatron.core.transformer.document_mask``), the mask the
attention kernels and the context-parallel blocks read; ``sbhd`` / ``bshd`` mean no packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.transformer.document_mask import DocumentMask

PACKED_FORMAT = "thd"
UNPACKED_FORMATS = ("sbhd", "bshd")


@dataclass
class PackedSeqParams:
    """Packed documents in Megatron-Core's fields (all optional, as there).

    Attributes:
        qkv_format: ``"thd"`` (tokens of several documents packed along one axis) or ``"sbhd"`` /
            ``"bshd"`` (no packing: the fields below are not read).
        cu_seqlens_q / cu_seqlens_kv: ``[num_docs + 1]`` int, each document's start offset in the
            packed tokens, ending with their total. Self-attention: the two are equal.
        cu_seqlens_q_padded / cu_seqlens_kv_padded: the same with padding between documents (TE's
            ``thd`` padding); padding is not built, so they must equal the unpadded ones or be None.
        max_seqlen_q / max_seqlen_kv: the longest document (int); given, the variable-length
            kernels need no host sync to find it.
        local_cp_size / cp_group: Megatron-Core's hybrid (per-batch) context parallelism, not built:
            None, or the model's own cp size / group.
    """

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: dist.ProcessGroup | None = None


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """``a`` is None or holds ``b``'s values (compared only when it is another tensor: on a GPU the
    comparison is a host sync)."""
    return a is None or a is b or (a.shape == b.shape and bool(torch.equal(a.to(b.device), b)))


def document_mask_of(
    params: PackedSeqParams | None,
    seq_length: int,
    batch_size: int,
    cp_size: int = 1,
    cp_group: dist.ProcessGroup | None = None,
) -> DocumentMask | None:
    """The ``DocumentMask`` of ``params`` for ``batch_size`` rows of ``seq_length`` tokens (the FULL
    sequence: with context parallelism ``cu_seqlens`` describe the packed sequence before its cut
    into the cp ranks' chunks), or None for no packing.

    Raises:
        ValueError: an unknown ``qkv_format``; ``thd`` without ``cu_seqlens_q``; kv or padded
            boundaries other than ``cu_seqlens_q``; ``local_cp_size`` / ``cp_group`` other than the
            model's (hybrid context parallelism is not built).
    """
    if params is None or params.qkv_format in UNPACKED_FORMATS:
        return None
    if params.qkv_format != PACKED_FORMAT:
        raise ValueError(
            f"PackedSeqParams.qkv_format={params.qkv_format!r} is not a format; pass "
            f"{PACKED_FORMAT!r} (packed documents) or one of {UNPACKED_FORMATS} (no packing)"
        )
    cu = params.cu_seqlens_q
    if cu is None:
        raise ValueError("PackedSeqParams(qkv_format='thd') needs cu_seqlens_q, the documents' offsets")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if not _same(getattr(params, name), cu):
            raise ValueError(
                f"PackedSeqParams.{name} differs from cu_seqlens_q: padding between documents and "
                f"cross-attention are not built; pass {name}=None or the same offsets as cu_seqlens_q"
            )
    if params.local_cp_size not in (None, cp_size):
        raise ValueError(
            f"PackedSeqParams.local_cp_size={params.local_cp_size}: hybrid context parallelism is not "
            f"built; pass None (the model's context_parallel_size, {cp_size}, applies)"
        )
    if params.cp_group is not None and params.cp_group is not cp_group:
        raise ValueError(
            "PackedSeqParams.cp_group is not the model's context-parallel group: hybrid context "
            "parallelism is not built; pass None"
        )
    max_seqlen = params.max_seqlen_q if params.max_seqlen_q is not None else params.max_seqlen_kv
    return DocumentMask.from_cu_seqlens(
        cu, seq_length, batch_size, None if max_seqlen is None else int(max_seqlen)
    )
