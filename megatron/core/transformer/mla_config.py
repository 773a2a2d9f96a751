"""Megatron-Core's ``MLATransformerConfig``: multi-latent attention is not built here, so constructing
one is refused (``multi_latent_attention=True``), naming the field. Its fields exist with
Megatron-Core's defaults so that the refusal, not a TypeError, is what a user sees."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import doc
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Refused on construction (see the module docstring)."""

    multi_latent_attention: bool = doc(True, flag=None)
    q_lora_rank: int = doc(512, flag=None)
    kv_lora_rank: int = doc(512, flag=None)
    qk_head_dim: int = doc(128, flag=None)
    qk_pos_emb_head_dim: int = doc(64, flag=None)
    v_head_dim: int = doc(128, flag=None)
    normalization: str = doc("RMSNorm", flag=None)
    rope_type: str = doc("yarn", flag=None)
    rotary_base: int = doc(10000, flag=None)
    rotary_percent: float = doc(1.0, flag=None)
    rotary_scaling_factor: float = doc(40, flag=None)
    original_max_position_embeddings: int = doc(4096, flag=None)
    beta_fast: float = doc(32, flag=None)
    beta_slow: float = doc(1, flag=None)
    mscale: float = doc(1.0, flag=None)
    mscale_all_dim: float = doc(0.0, flag=None)
    cache_mla_latents: bool = doc(False, flag=None)
    mla_down_proj_fusion: bool = doc(False, flag=None)
