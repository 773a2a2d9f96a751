"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import accepts_keyword, build_module

Rotary = tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class TransformerLayerSubmodules:
    """The layer's submodules, with Megatron-Core's fields. The bias-dropout-adds (``*_bda``) are this
    layer's own whatever the spec names; cross attention is not built (it must stay None or
    IdentityOp); ``sharded_state_dict_keys_map`` is accepted (checkpoint keys are GPTModel's)."""

    input_layernorm: Any = None
    self_attention: Any = None
    self_attn_bda: Any = None
    pre_cross_attn_layernorm: Any = None
    cross_attention: Any = None
    cross_attn_bda: Any = None
    pre_mlp_layernorm: Any = None
    mlp: Any = None
    mlp_bda: Any = None
    sharded_state_dict_keys_map: dict[str, str] = field(default_factory=dict)


def bias_dropout_add(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    rng_tracker: Any = None,
) -> torch.Tensor:
    """residual + dropout(out + bias). ``rng_tracker`` forks the tensor-parallel RNG (sequence-sharded
    activations: every rank draws its own mask); otherwise the default RNG, identical across tp."""
    if bias is not None:
        out = out + bias
    if rng_tracker is not None and training and p > 0:
        with rng_tracker.fork():
            return residual + F.dropout(out, p=p, training=training)
    return residual + F.dropout(out, p=p, training=training)


class TransformerLayer(nn.Module):
    """A decoder layer. ``layer_number`` is 1-based and global (pipeline stages offset it).
    ``cp_groups`` (context parallelism, ``context_parallel.layout.ContextParallelGroups``) goes to
    the self-attention, ``moe_groups`` (``moe.groups.MoEGroups``, with ``layer_number``) to the mlp,
    each only when given."""

    def __init__(
        self,
        config: Any,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng_tracker: Any = None,
        cp_groups: Any = None,
        moe_groups: Any = None,
    ) -> None:
        super().__init__()
        cp = {} if cp_groups is None else {"cp_groups": cp_groups}
        if getattr(submodules, "cross_attention", None) not in (None, IdentityOp):
            raise ConfigError(
                "TransformerLayerSubmodules.cross_attention is not built here (decoder-only layers); "
                "leave it None or IdentityOp"
            )
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.dropout_tracker = rng_tracker if sequence_parallel else None
        sp = dict(sequence_parallel=sequence_parallel)
        self.input_layernorm = build_module(submodules.input_layernorm, config, config.hidden_size, **sp)
        self.self_attention = build_module(
            submodules.self_attention,
            config,
            layer_number=layer_number,
            tp_group=tp_group,
            rng_tracker=rng_tracker,
            **sp,
            **cp,
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, config.hidden_size, **sp)
        # the MoE groups (models with experts) go to an mlp that takes them: an MoE layer, not the dense
        # MLP of a layer the pattern leaves dense
        moe = {}
        if moe_groups is not None and accepts_keyword(submodules.mlp, "moe_groups"):
            moe = {"moe_groups": moe_groups, "layer_number": layer_number}
        self.mlp = build_module(submodules.mlp, config, tp_group=tp_group, **sp, **moe)

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, rotary: Rotary = None
    ) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``s`` is the local shard with sequence parallelism)."""
        out, bias = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary)
        hidden = bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training, self.dropout_tracker)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden))
        return bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training, self.dropout_tracker)
