"""LayerNorm and RMSNorm over the last dim, chosen by ``config.normalization``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.init import set_init_attrs, tag_param


class Norm(nn.Module):
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only) of ``hidden_size`` channels.

    With ``config.apply_layernorm_1p`` (Megatron's zero-centred gamma) the stored weight ``w`` starts
    at 0 and the norm scales by ``1 + w``: the same function as a plain norm whose weight is ``1 + w``.
    ``sequence_parallel`` marks the parameters so their gradients are all-reduced across the tp
    group (they see only this rank's sequence shard).
    """

    def __init__(
        self, config: Any, hidden_size: int, eps: float | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.kind = config.normalization
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.hidden_size = hidden_size
        self.zero_centered_gamma = config.apply_layernorm_1p
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
        self.bias: nn.Parameter | None
        set_init_attrs(self.weight, value=0.0 if self.zero_centered_gamma else 1.0)
        tag_param(self.weight, sequence_parallel=sequence_parallel)
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
            set_init_attrs(self.bias, value=0.0)
            tag_param(self.bias, sequence_parallel=sequence_parallel)
        else:
            self.bias = None

    def scale(self) -> torch.Tensor:
        """The weight the norm multiplies by: ``1 + w`` (in the weight's dtype) with zero-centred gamma."""
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), self.scale(), self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.scale(), self.eps)


def build_norm(config: Any, hidden_size: int, sequence_parallel: bool = False) -> Norm:
    return Norm(config, hidden_size, sequence_parallel=sequence_parallel)
