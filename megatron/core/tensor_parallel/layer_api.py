"""Megatron-Core's functional linear, parameter attributes, and the construction of a parallel layer
from Megatron's ``(config=, init_method=)`` form. :mod:`layers` re-exports the public names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.mappings import ProcessGroup, default_tp_group
from megatron.core.tensor_parallel.rng_api import get_cuda_rng_tracker

# Megatron-Core's tensor-parallel attributes of a parameter and their values when not set.
TP_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` as (not) split across tp along ``dim`` with ``stride`` interleaved sub-blocks.

    Raises:
        ValueError: one of the attributes is set already.
    """
    for attribute in TP_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(
                f"set_tensor_model_parallel_attributes: the tensor already has {attribute!r}; "
                "use copy_tensor_model_parallel_attributes or a fresh tensor"
            )
    tensor.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    tensor.partition_dim = dim  # type: ignore[attr-defined]
    tensor.partition_stride = stride  # type: ignore[attr-defined]


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` every tensor-parallel attribute it lacks, with its not-parallel value."""
    for attribute, value in TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``."""
    for attribute in TP_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_group: ProcessGroup | None = None, expert_tp_group: ProcessGroup | None = None
) -> bool:
    """True when ``param`` is a tp shard, or a replicated parameter on tp rank 0 (count it once):
    what a norm or a parameter count over tp ranks should include. An expert parameter
    (``allreduce=False``) is judged on ``expert_tp_group`` when given; default the default tp group."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    return mappings.group_rank(default_tp_group(tp_group)) == 0


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    tp_group: ProcessGroup | None = None,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """``input @ weight.T + bias`` of a column-parallel linear with its tp collectives.

    Forward: with ``sequence_parallel`` the input ``[s/tp, b, in]`` is all-gathered along dim 0 first
    (backward: its gradient reduce-scattered); with ``allreduce_dgrad`` the input gradient is
    all-reduced over tp in backward; neither: a plain linear. ``tp_group`` defaults to the default
    tp group. ``gradient_accumulation_fusion`` has no effect: the weight gradient lands in ``.grad``
    and the DDP wrapper accumulates it (no APEX kernel). The communication is not overlapped with the
    weight-gradient GEMM.

    Raises:
        ValueError: both ``allreduce_dgrad`` and ``sequence_parallel``; a ``grad_output_buffer``
            (deferred embedding wgrad) or ``gtp_remat_size`` other than 1, which are not built here.
    """
    if allreduce_dgrad and sequence_parallel:
        raise ConfigError(
            "linear_with_grad_accumulation_and_async_allreduce: allreduce_dgrad must be False with "
            "sequence_parallel=True (the input gradient is reduce-scattered instead)",
            params=("allreduce_dgrad", "sequence_parallel"),
        )
    if grad_output_buffer is not None:
        raise ConfigError(
            "grad_output_buffer (deferred embedding wgrad) is not supported; pass None",
            params=("grad_output_buffer",),
        )
    if gtp_remat_size != 1:
        raise ConfigError(
            f"gtp_remat_size={gtp_remat_size} is not supported; pass 1", params=("gtp_remat_size",)
        )
    group = default_tp_group(tp_group)
    if sequence_parallel:
        input = mappings.gather_from_sp(input, group)
    elif allreduce_dgrad:
        input = mappings.copy_to_tp(input, group)
    return F.linear(input, weight, bias)


class MegatronForm:
    """What a parallel layer built as ``(config=, init_method=)`` takes from Megatron's config."""

    def __init__(
        self, config: Any, init_method: Callable[[torch.Tensor], Any] | None, tp_group: ProcessGroup | None
    ):
        if init_method is None:
            raise ConfigError(
                "a parallel layer built with config= needs init_method= (e.g. "
                "megatron.core.utils.init_method_normal(0.02)) as in Megatron-Core",
                params=("init_method",),
            )
        self.config, self.init_method = config, init_method
        self.tp_group = default_tp_group(tp_group)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.params_dtype: torch.dtype = getattr(config, "params_dtype", torch.float32)
        self.init_std = float(getattr(config, "init_method_std", 0.02))
        cpu = bool(getattr(config, "use_cpu_initialization", False)) or not torch.cuda.is_available()
        self.device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())

    @torch.no_grad()
    def init_weight_(self, weight: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
        """Megatron's initialisation of a tp shard (when ``config.perform_initialization``): with
        ``use_cpu_initialization`` the full weight from the default CPU generator, then this rank's
        (strided) blocks; else ``init_method`` on the shard under the tracker's model-parallel state."""
        if not getattr(self.config, "perform_initialization", True):
            return
        tp, rank = mappings.group_size(self.tp_group), mappings.group_rank(self.tp_group)
        if getattr(self.config, "use_cpu_initialization", False):
            full_shape = list(weight.shape)
            full_shape[partition_dim] *= tp
            full = torch.empty(full_shape, dtype=torch.float32)
            self.init_method(full)
            per_stride = weight.shape[partition_dim] // stride
            mine = torch.split(full, per_stride, dim=partition_dim)[rank::tp]
            weight.copy_(torch.cat(mine, dim=partition_dim))
            return

        tracker = get_cuda_rng_tracker()
        if "model-parallel-rng" in tracker.names():
            with tracker.fork():
                self.init_method(weight)
        else:
            self.init_method(weight)
