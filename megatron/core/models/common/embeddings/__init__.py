"""Embeddings of the language models: token (+ learned position) embedding and rotary embeddings,
at Megatron-Core's module paths."""

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding", "apply_rotary_pos_emb"]
