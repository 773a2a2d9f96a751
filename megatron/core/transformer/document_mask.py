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

import torch


@dataclass
class DocumentMask:
    """``doc_ids`` ``[b, S]`` int: the document index of each token of the full sequence (non-decreasing
    along the sequence). Query ``i`` sees key ``j`` when ``j <= i`` and both are in the same document."""

    doc_ids: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod: int) -> DocumentMask:
        """The documents of ``tokens`` ``[b, S]``: a new document starts after each end-of-document
        token (the EOD belongs to the document it ends), as GPTDataset's --reset-attention-mask."""
        ends = (tokens == eod).to(torch.int32)
        doc_ids = torch.zeros_like(ends)
        doc_ids[:, 1:] = torch.cumsum(ends[:, :-1], dim=1)
        return cls(doc_ids)

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
        """The whole ``[b, 1, S, S]`` mask (True = masked): GPTDataset's --reset-attention-mask mask."""
        index = torch.arange(self.seq_length, device=self.doc_ids.device)
        return self.block_mask(index, index)
