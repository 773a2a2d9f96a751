"""Tensor-parallel building blocks: column/row-parallel linears and the vocab-parallel embedding.

Weights are stored in the ``[out, in]`` convention of ``torch.nn.Linear``. A column-parallel
linear holds rows ``[r*out/tp, (r+1)*out/tp)`` of the logical weight (``partition_dim`` 0), a
row-parallel linear holds columns ``[r*in/tp, (r+1)*in/tp)`` (``partition_dim`` 1). Layers return
``(output, bias)`` as Megatron-Core does: ``bias`` is ``None`` unless ``skip_bias_add`` asks the
caller to fuse the bias into a later op.

The local GEMM is chosen at construction: ``F.linear``, or with ``fp8_gemm`` (a builder the layer
spec passes, ``execution_plan.Fp8GemmBuilder``) an FP8 GEMM held as the ``fp8`` submodule (scaling
state only) that runs on the same local shards, between the same collectives. Weights, checkpoints
and the tp/sp semantics are the same either way.

Two constructor forms. The library's: ``init_std=`` with ``tp_group`` (None: no tensor
parallelism), ``sequence_parallel`` and ``params_dtype`` given, parameters on the CPU, values set
later by the layout-invariant init (``init.init_param_``). Megatron-Core's: ``config=`` and
``init_method=``; then an omitted ``tp_group`` is the default ParallelState's tp group, sequence
parallelism and dtype come from the config, the parameters are allocated on the current GPU
(CPU with ``use_cpu_initialization`` or without CUDA) and initialised at construction as Megatron
does (``init_method`` under the tracker's model-parallel state, or the full weight on the CPU and
this rank's block); ``init_std`` records ``config.init_method_std`` for a later re-initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.init import set_init_attrs, tag_param
from megatron.core.tensor_parallel.layer_api import (
    MegatronForm,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import ProcessGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

InitMethod = Callable[[torch.Tensor], Any]
# ``(x [..., in], weight [out, in], bias [out] or None) -> [..., out]``: the local GEMM.
Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# Builds an FP8 GEMM module for a linear whose parameters live on the given device.
GemmBuilder = Callable[[torch.device], nn.Module]


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ConfigError(
            f"{what} ({n}) is not divisible by tensor_model_parallel_size {d}",
            params=("tensor_model_parallel_size",),
        )
    return n // d


def _local_gemm(fp8: nn.Module | None) -> Gemm:
    """The GEMM ``forward`` calls: ``F.linear``, or the FP8 module's ``__call__``."""
    return F.linear if fp8 is None else fp8.__call__


def _build_fp8(builder: GemmBuilder | None, weight: torch.Tensor | None) -> nn.Module | None:
    """The FP8 GEMM module of a linear (None: the GEMM runs in the weight's dtype). The layer spec
    passes a builder only for weights whose dims FP8 can take (multiples of 16)."""
    if builder is None or weight is None:
        return None
    assert weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0, (
        f"FP8 GEMM for a {list(weight.shape)} weight"
    )
    return builder(weight.device)


def _megatron_form(
    cls: str,
    init_std: float | None,
    config: Any,
    init_method: InitMethod | None,
    tp_group: ProcessGroup | None,
) -> MegatronForm | None:
    """The Megatron-Core form's settings, or None for the library's form (``init_std=``)."""
    if config is None:
        if init_std is None:
            raise ValueError(
                f"{cls} needs init_std= (this library's form) or config= and init_method= "
                "(Megatron-Core's form)"
            )
        return None
    return MegatronForm(config, init_method, tp_group)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by output rows across the tp group.

    Args:
        input_size / output_size: logical (unsharded) sizes.
        init_std: std of the normal init of the weight.
        bias: whether to add a bias (sharded like the output).
        gather_output: all-gather the output's last dim (otherwise it stays tp-sharded).
        sequence_parallel: the input is sharded along the sequence dim and all-gathered here.
        partition_stride: >1 when the output stacks that many sub-tensors that are split separately
            (SwiGLU's [gate; up]).
        skip_weight_param_allocation: no weight of its own; ``forward`` takes ``weight`` (tied output layer).
        config / init_method / stride: Megatron-Core's form (module docstring); ``stride`` is
            ``partition_stride``. keep_master_weight_for_test, embedding_activation_buffer,
            grad_output_buffer, is_expert, tp_comm_buffer_name and name are accepted for its
            signature and have no effect.
        disable_grad_reduce: without sequence parallelism, the input's gradient is left as this
            rank's partial sum (no all-reduce over tp); the caller reduces it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        init_std: float | None = None,
        bias: bool = True,
        tp_group: ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        partition_stride: int = 1,
        skip_weight_param_allocation: bool = False,
        params_dtype: torch.dtype = torch.float32,
        config: Any = None,
        init_method: InitMethod | None = None,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        embedding_activation_buffer: list | None = None,
        grad_output_buffer: list | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        name: str | None = None,
        fp8_gemm: GemmBuilder | None = None,
    ) -> None:
        super().__init__()
        form = _megatron_form("ColumnParallelLinear", init_std, config, init_method, tp_group)
        device = torch.device("cpu")
        if form is not None:
            tp_group, sequence_parallel, params_dtype = (
                form.tp_group,
                form.sequence_parallel,
                form.params_dtype,
            )
            init_std, partition_stride, device = form.init_std, stride, form.device
        assert init_std is not None
        self.input_size, self.output_size = input_size, output_size
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_group = tp_group
        self.tp_size = mappings.group_size(tp_group)
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.skip_bias_add = skip_bias_add
        self.weight: nn.Parameter | None
        self.bias: nn.Parameter | None
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype, device=device)
            )
            set_init_attrs(
                self.weight,
                std=init_std,
                partition_dim=0,
                partition_size=self.tp_size,
                partition_stride=partition_stride,
            )
            if form is not None:
                form.init_weight_(self.weight, 0, partition_stride)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_init_attrs(
                self.bias, partition_dim=0, partition_size=self.tp_size, partition_stride=partition_stride
            )
        else:
            self.bias = None
        self.fp8 = _build_fp8(fp8_gemm, self.weight)
        self._gemm = _local_gemm(self.fp8)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, in]`` (``[s/tp, b, in]`` with sequence parallelism) -> ``([s, b, out/tp], bias)``,
        or ``[s, b, out]`` with ``gather_output`` (``runtime_gather_output``, when not None, decides
        instead for this call). ``weight`` replaces the own weight (tied output layer).

        Collectives: without sequence parallelism the input enters through ``copy_to`` (backward
        all-reduces its gradient); with it the input is all-gathered along the sequence (backward
        reduce-scatters), and the weight gradient is computed on the gathered input.
        """
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError(
                "ColumnParallelLinear built with skip_weight_param_allocation needs forward(x, weight=...)"
            )
        x = self.input_collective(x)
        bias = None if self.skip_bias_add else self.bias
        out = self._gemm(x, weight, bias)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            out = mappings.gather_from_tp(out, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)

    def input_collective(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the local GEMM reads it: all-gathered along the sequence with sequence
        parallelism, else as is (in both cases backward reduces its gradient over the tp group,
        unless ``disable_grad_reduce`` without sequence parallelism)."""
        if self.sequence_parallel:
            return mappings.gather_from_sp(x, self.tp_group)
        if self.disable_grad_reduce:
            return x
        return mappings.copy_to_tp(x, self.tp_group)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by input columns; the partial outputs are summed across the tp group.

    The input is already tp-sharded along its last dim. With ``sequence_parallel`` the sum is a
    reduce-scatter along the sequence dim instead of an all-reduce. The bias is added after the sum.

    ``input_is_parallel=False`` (Megatron-Core's) takes a replicated input and keeps this rank's block
    of its last dim first. config / init_method / stride: Megatron-Core's form (module docstring);
    keep_master_weight_for_test, is_expert, tp_comm_buffer_name and name have no effect.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        init_std: float | None = None,
        bias: bool = True,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        config: Any = None,
        init_method: InitMethod | None = None,
        input_is_parallel: bool = True,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        name: str | None = None,
        fp8_gemm: GemmBuilder | None = None,
    ) -> None:
        super().__init__()
        form = _megatron_form("RowParallelLinear", init_std, config, init_method, tp_group)
        device = torch.device("cpu")
        if form is not None:
            tp_group, sequence_parallel, params_dtype = (
                form.tp_group,
                form.sequence_parallel,
                form.params_dtype,
            )
            init_std, device = form.init_std, form.device
        assert init_std is not None
        if sequence_parallel and not input_is_parallel:
            raise ConfigError(
                "RowParallelLinear: sequence_parallel needs input_is_parallel=True",
                params=("sequence_parallel",),
            )
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.tp_group = tp_group
        self.tp_size = mappings.group_size(tp_group)
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype, device=device)
        )
        set_init_attrs(self.weight, std=init_std, partition_dim=1, partition_size=self.tp_size)
        if form is not None:
            form.init_weight_(self.weight, 1, stride)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_init_attrs(self.bias)
            # Replicated across tp but fed by sequence-sharded outputs: its grad needs a tp all-reduce.
            tag_param(self.bias, sequence_parallel=self.sequence_parallel)
        else:
            self.bias = None
        self.fp8 = _build_fp8(fp8_gemm, self.weight)
        self._gemm = _local_gemm(self.fp8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, in/tp]`` -> ``([s, b, out], bias)`` (``[s/tp, b, out]`` with sequence parallelism).

        Collectives: forward all-reduce (backward identity), or with sequence parallelism a
        reduce-scatter along the sequence (backward all-gather).
        """
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp(x, self.tp_group)
        out = self.output_collective(self._gemm(x, self.weight, None))
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    def output_collective(self, out: torch.Tensor) -> torch.Tensor:
        """The local GEMM's partial output summed over the tp group: reduce-scattered along the
        sequence with sequence parallelism, else all-reduced."""
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sp(out, self.tp_group)
        return mappings.reduce_from_tp(out, self.tp_group)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split into contiguous ranges across the tp group.

    Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)``. Ids outside this rank's range look up row 0 and
    are zeroed; the partial results are summed across the group: an all-reduce giving ``[b, s, h]``,
    or with ``reduce_scatter_embeddings`` a reduce-scatter along the sequence giving ``[s/tp, b, h]``
    (sequence-first, ready for the sequence-parallel region).

    config / init_method: Megatron-Core's form (module docstring).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_std: float | None = None,
        tp_group: ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        reduce_scatter_embeddings: bool = False,
        config: Any = None,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        form = _megatron_form("VocabParallelEmbedding", init_std, config, init_method, tp_group)
        device = torch.device("cpu")
        if form is not None:
            tp_group, params_dtype, init_std, device = (
                form.tp_group,
                form.params_dtype,
                form.init_std,
                form.device,
            )
        assert init_std is not None
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tp_size = mappings.group_size(tp_group)
        self.num_embeddings = num_embeddings
        self.num_per_partition = _divide(num_embeddings, self.tp_size, "padded vocabulary size")
        self.vocab_start = mappings.group_rank(tp_group) * self.num_per_partition
        self.vocab_start_index, self.vocab_end_index = (
            self.vocab_start,
            self.vocab_start + self.num_per_partition,
        )
        self.num_embeddings_per_partition = self.num_per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and self.tp_size > 1
        self.weight = nn.Parameter(
            torch.empty(self.num_per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        set_init_attrs(self.weight, std=init_std, partition_dim=0, partition_size=self.tp_size)
        if form is not None:
            form.init_weight_(self.weight, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` ids -> ``[b, s, h]``, or ``[s/tp, b, h]`` with ``reduce_scatter_embeddings``."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h], partial over the vocabulary
        if self.reduce_scatter_embeddings:
            out = out.transpose(0, 1).contiguous()  # [s, b, h]
            return mappings.reduce_scatter_to_sp(out, self.tp_group)
        return mappings.reduce_from_tp(out, self.tp_group)
