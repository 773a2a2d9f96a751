"""This rank's local experts, stacked: one weight tensor per linear holding every local expert.

``linear_fc1.weight`` ``[E_local, fc1_out / etp, h]`` (``fc1_out`` = ``2 F`` ``[gate; up]`` with
SwiGLU, each half split over expert-tp like the dense MLP's fc1), ``linear_fc2.weight``
``[E_local, h, F / etp]``; with ``add_bias_linear`` ``linear_fc1.bias`` ``[E_local, fc1_out / etp]``
and ``linear_fc2.bias`` ``[E_local, h]``. ``F`` is ``moe_ffn_hidden_size`` (default
``ffn_hidden_size``). Every parameter is tagged with ``expert_params.tag_expert_param`` (global
expert offset, etp split), which is what initialisation, DDP, the optimizer and checkpoints read.

Under expert-tp each rank's fc2 output is a partial sum over its block of ``F``: the token
dispatcher sums it over the etp ranks when it returns the tokens.

Two ways to compute, the same results: a loop over the local experts, and (``moe_grouped_gemm``)
one ``torch._grouped_mm`` per linear over all local experts. :func:`grouped_gemm_applies` alone
decides which runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.fusions.compile import MaybeCompiled
from megatron.core.transformer.mlp import config_activation
from megatron.core.transformer.moe.expert_params import tag_expert_param
from megatron.core.transformer.moe.groups import MoEGroups

TokensPerExpert = torch.Tensor | Sequence[int]


def moe_ffn_size(config: Any) -> int:
    """The experts' hidden size ``F``: ``moe_ffn_hidden_size``, else ``ffn_hidden_size``."""
    size = getattr(config, "moe_ffn_hidden_size", None)
    return int(size if size is not None else config.ffn_hidden_size)


@functools.cache
def _grouped_mm_runs_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this torch has a CPU ``_grouped_mm`` for ``dtype`` (torch 2.13 has one)."""
    try:
        a, b = torch.zeros(4, 8, dtype=dtype), torch.zeros(2, 8, 8, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def grouped_gemm_applies(requested: bool, tokens: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts: ``moe_grouped_gemm`` requested, and the op
    takes these tensors (at least one row): on CUDA bf16 on Hopper or newer (compute capability >= 9.0); on the CPU
    where this torch has the op for the dtype; every GEMM dim a multiple of 16 bytes (the op's
    stride rule). Otherwise the loop runs."""
    if not requested or not hasattr(torch, "_grouped_mm") or tokens.shape[0] == 0:
        return False
    if any(w.dtype != tokens.dtype for w in weights):
        return False
    if tokens.is_cuda:
        if tokens.dtype != torch.bfloat16 or torch.cuda.get_device_capability(tokens.device) < (9, 0):
            return False
    elif tokens.device.type != "cpu" or not _grouped_mm_runs_on_cpu(tokens.dtype):
        return False
    elements = 16 // tokens.element_size()
    return all(w.shape[1] % elements == 0 and w.shape[2] % elements == 0 for w in weights)


class _StackedLinear(nn.Module):
    """Holds one linear's stacked expert parameters (``weight`` ``[E_local, out, in]``, ``bias``
    ``[E_local, out]``); the GEMM is :class:`GroupedExperts`'."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


class GroupedExperts(nn.Module):
    """The ``num_local_experts`` experts of this ep rank (global experts ``[ep_rank * E_local,
    (ep_rank + 1) * E_local)``), each an MLP ``h -> F -> h`` split over expert-tp.

    Args:
        num_local_experts: ``num_moe_experts / ep``.
        config: a ``TransformerConfig`` (``num_moe_experts``, ``hidden_size``, ``moe_ffn_hidden_size``
            / ``ffn_hidden_size``, ``activation``, ``add_bias_linear``, ``params_dtype``,
            ``init_method_std``, ``output_layer_init_std``, ``moe_grouped_gemm``).
        groups: the MoE groups (ep and etp sizes and ranks); None: one rank.
        submodules: accepted for Megatron-Core's expert specs; has no effect (the linears are
            this class's stacked parameters).

    Raises:
        ConfigError: ``F`` not divisible by the expert-tp size, or biases with expert-tp > 1.
    """

    def __init__(
        self, num_local_experts: int, config: Any, groups: MoEGroups | None = None, submodules: Any = None
    ) -> None:
        super().__init__()
        groups = groups or MoEGroups()
        etp = groups.etp_size
        ffn = moe_ffn_size(config)
        if ffn % etp != 0:
            raise ConfigError(
                f"moe_ffn_hidden_size ({ffn}) is not divisible by expert_tensor_parallel_size ({etp}); "
                "choose an expert FFN size that the expert-tp size divides",
                params=("moe_ffn_hidden_size", "expert_tensor_parallel_size"),
            )
        if config.add_bias_linear and etp > 1:
            raise ConfigError(
                f"expert biases (add_bias_linear) with expert_tensor_parallel_size {etp} are not "
                "supported: use add_bias_linear=False (--disable-bias-linear) or "
                "expert_tensor_parallel_size 1",
                params=("add_bias_linear", "expert_tensor_parallel_size"),
            )
        gated = config.activation == "swiglu"
        self.num_local_experts = num_local_experts
        self.grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
        self.activation = config_activation(config)
        self._compiled_activation = MaybeCompiled(self.activation)
        # Whether the rows may end in padding (past the last expert's offset). False when the
        # dispatcher gives every row to an expert (its exact path); MoELayer sets both flags.
        self.padded_rows = True
        self.compile_helpers = False  # the activation compiled between the grouped GEMMs (the plan's choice)
        h, dtype = config.hidden_size, config.params_dtype
        fc1_out = ffn * (2 if gated else 1) // etp
        tags = dict(
            num_experts=config.num_moe_experts,
            ep_rank=groups.ep_rank,
            ep_size=groups.ep_size,
            etp_rank=groups.etp_rank,
        )
        stride = 2 if gated else 1
        w1 = nn.Parameter(torch.empty(num_local_experts, fc1_out, h, dtype=dtype))
        tag_expert_param(
            w1,
            init_std=config.init_method_std,
            partition_dim=1,
            partition_size=etp,
            partition_stride=stride,
            **tags,
        )
        w2 = nn.Parameter(torch.empty(num_local_experts, h, ffn // etp, dtype=dtype))
        tag_expert_param(
            w2, init_std=config.output_layer_init_std, partition_dim=2, partition_size=etp, **tags
        )
        b1 = b2 = None
        if config.add_bias_linear:
            b1 = nn.Parameter(torch.zeros(num_local_experts, fc1_out, dtype=dtype))
            tag_expert_param(b1, partition_dim=1, partition_size=etp, partition_stride=stride, **tags)
            b2 = nn.Parameter(torch.zeros(num_local_experts, h, dtype=dtype))
            tag_expert_param(b2, **tags)
        self.linear_fc1 = _StackedLinear(w1, b1)
        self.linear_fc2 = _StackedLinear(w2, b2)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: TokensPerExpert) -> torch.Tensor:
        """Run each local expert on its rows.

        Args:
            tokens: ``[M, h]``, rows grouped by local expert (expert 0's first); rows past
                ``sum(tokens_per_expert)`` are padding.
            tokens_per_expert: ``[E_local]`` row counts, a device tensor or host ints. The grouped
                GEMM reads them on the device (no host sync); the loop needs them on the host (one
                copy when given a device tensor).

        Returns:
            ``[M, h]``: expert outputs (partial sums over expert-tp); padding rows are unspecified.
        """
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if grouped_gemm_applies(self.grouped_gemm, tokens, (w1, w2)):
            return self._grouped(tokens, tokens_per_expert)
        return self._loop(tokens, tokens_per_expert)

    def _loop(self, tokens: torch.Tensor, tokens_per_expert: TokensPerExpert) -> torch.Tensor:
        counts = (
            tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
        )
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        outs, start = [], 0
        for i, n in enumerate(counts):
            x = tokens[start : start + n]  # [n, h]
            b1 = None if fc1.bias is None else fc1.bias[i]
            b2 = None if fc2.bias is None else fc2.bias[i]
            outs.append(F.linear(self.activation(F.linear(x, fc1.weight[i], b1)), fc2.weight[i], b2))
            start += n
        outs.append(tokens.new_zeros(tokens.shape[0] - start, fc2.weight.shape[1]))  # padding rows
        return torch.cat(outs)

    def _grouped(self, tokens: torch.Tensor, tokens_per_expert: TokensPerExpert) -> torch.Tensor:
        counts = torch.as_tensor(tokens_per_expert, device=tokens.device)
        offs = counts.cumsum(0).to(torch.int32)  # [E_local] end row of each expert
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not self.padded_rows and fc1.bias is None and fc2.bias is None:
            x = torch._grouped_mm(tokens, fc1.weight.transpose(1, 2), offs=offs)  # every row an expert's
            x = self._compiled_activation(x, compile=self.compile_helpers)
            return torch._grouped_mm(x, fc2.weight.transpose(1, 2), offs=offs)
        # The op leaves rows past the last offset unset (forward and input gradient): padding rows
        # index an appended zero bias, and fc2 reads them as zeros, so nothing unset reaches a
        # weight gradient.
        rows = torch.arange(tokens.shape[0], device=tokens.device, dtype=torch.int32)
        row_expert = torch.searchsorted(offs, rows, right=True)  # [M], E_local for padding rows
        x = torch._grouped_mm(tokens, fc1.weight.transpose(1, 2), offs=offs)  # [M, fc1_out / etp]
        if fc1.bias is not None:
            x = x + _with_zero_row(fc1.bias)[row_expert]
        hidden = torch.where((row_expert < self.num_local_experts).unsqueeze(1), self.activation(x), 0.0)
        y = torch._grouped_mm(hidden, fc2.weight.transpose(1, 2), offs=offs)  # [M, h]
        if fc2.bias is not None:
            y = y + _with_zero_row(fc2.bias)[row_expert]
        return y


def _with_zero_row(bias: torch.Tensor) -> torch.Tensor:
    """``[E_local, n]`` -> ``[E_local + 1, n]``, the last row zeros."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
