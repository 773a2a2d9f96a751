"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.spec_utils import build_module


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: object = None
    self_attention: object = None
    pre_mlp_layernorm: object = None
    mlp: object = None


def bias_dropout_add(out: torch.Tensor, bias, residual: torch.Tensor, p: float, training: bool,
                     rng_tracker=None) -> torch.Tensor:
    """residual + dropout(out + bias). ``rng_tracker`` forks the tensor-parallel RNG (sequence-sharded
    activations: every rank draws its own mask); otherwise the default RNG, identical across tp."""
    if bias is not None:
        out = out + bias
    if rng_tracker is not None and training and p > 0:
        with rng_tracker.fork():
            return residual + F.dropout(out, p=p, training=training)
    return residual + F.dropout(out, p=p, training=training)


class TransformerLayer(nn.Module):
    """A decoder layer. ``layer_number`` is 1-based and global (pipeline stages offset it)."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1, tp_group=None,
                 sequence_parallel: bool = False, rng_tracker=None):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.dropout_tracker = rng_tracker if sequence_parallel else None
        sp = dict(sequence_parallel=sequence_parallel)
        self.input_layernorm = build_module(submodules.input_layernorm, config, config.hidden_size, **sp)
        self.self_attention = build_module(submodules.self_attention, config, layer_number=layer_number,
                                           tp_group=tp_group, rng_tracker=rng_tracker, **sp)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, config.hidden_size, **sp)
        self.mlp = build_module(submodules.mlp, config, tp_group=tp_group, **sp)

    def forward(self, hidden: torch.Tensor, attention_mask=None, rotary=None) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``s`` is the local shard with sequence parallelism)."""
        out, bias = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary)
        hidden = bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training, self.dropout_tracker)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden))
        return bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training, self.dropout_tracker)
