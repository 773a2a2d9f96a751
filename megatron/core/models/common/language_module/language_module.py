"""LanguageModule: the base of GPTModel, with Megatron-Core's loss helper."""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.parallel_state import get_parallel_state
from megatron.core.tensor_parallel.cross_entropy import sharded_cross_entropy
from megatron.core.transformer.module import MegatronModule


class LanguageModule(MegatronModule):
    """A MegatronModule that ends in vocabulary logits. ``self.pg`` (set by the subclass) holds the
    process groups; without one the default ParallelState's are used."""

    def __init__(self, config: Any, pg_collection: Any = None):
        super().__init__(config)
        if pg_collection is not None:
            self.pg = pg_collection

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy, as Megatron-Core computes it.

        Args:
            labels: ``[b, s]`` token ids.
            logits: ``[s, b, V/tp]`` this rank's vocabulary shard (sequence first).

        Returns:
            ``[b, s]`` fp32 losses (the same on every tensor-parallel rank).
        """
        pg = getattr(self, "pg", None) or get_parallel_state()
        loss = sharded_cross_entropy(logits, labels.transpose(0, 1).contiguous(), pg.tp_group)  # [s, b]
        return loss.transpose(0, 1).contiguous()
