"""Token (+ learned position) embedding producing sequence-first activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.init import set_init_attrs
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding


class LanguageModelEmbedding(nn.Module):
    """``[b, s]`` ids (and positions) -> ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)."""

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str,
        tp_group=None,
        sequence_parallel: bool = False,
        rng_tracker=None,
    ):
        super().__init__()
        self.rng_tracker = rng_tracker
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and mappings.group_size(tp_group) > 1
        self.dropout_p = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_std=config.init_method_std,
            tp_group=tp_group,
            params_dtype=config.params_dtype,
        )
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
            set_init_attrs(self.position_embeddings.weight, std=config.init_method_std)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        emb = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            emb = emb + self.position_embeddings(position_ids)
        emb = emb.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            emb = mappings.scatter_to_sp(emb, self.tp_group)
            if self.rng_tracker is not None:  # each rank drops out its own sequence shard
                with self.rng_tracker.fork():
                    return F.dropout(emb, p=self.dropout_p, training=self.training)
        return F.dropout(emb, p=self.dropout_p, training=self.training)
