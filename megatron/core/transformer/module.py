"""Megatron-Core's module base classes: ``MegatronModule`` (a module that holds its config) and
``Float16Module`` (runs a module in fp16 / bf16 with fp32 inputs and outputs at the model's ends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.parallel_state import get_parallel_state


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter tagged ``shared`` (e.g. the last stage's copy of a tied embedding)."""
    return not getattr(param, "shared", False)


class MegatronModule(nn.Module):
    """A module built from a config (``self.config``), with Megatron-Core's checkpoint hooks.

    ``sharded_state_dict`` (default implementation): every tensor of ``state_dict`` as a
    ``ShardedTensor`` under ``prefix + name``, split along its tensor-parallel dim where it has one
    (this package's parallel layers tag their parameters) and replicated otherwise. Models override it
    (GPTModel maps layers to their global numbers). The process groups are ``self.pg`` when the
    module has one, else the default ParallelState.
    """

    def __init__(self, config: Any):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """The state dict a checkpoint saves: ``state_dict(prefix=prefix, keep_vars=keep_vars)``."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """See the class docstring.

        Raises:
            ValueError: ``sharded_offsets`` given (extra leading shard axes are not supported by the
                default implementation).
        """
        if sharded_offsets:
            raise ValueError(
                f"MegatronModule.sharded_state_dict(sharded_offsets={sharded_offsets!r}) is not "
                "supported by the default implementation; pass sharded_offsets=()"
            )
        pg = getattr(self, "pg", None) or get_parallel_state()
        return {
            prefix + name: shard_of(prefix + name, tensor, pg.tp_rank, pg.dp_rank, pg.expt_dp_rank)
            for name, tensor in self.state_dict(prefix="", keep_vars=True).items()
        }

    def set_is_first_microbatch(self) -> None:
        """Mark every submodule with an ``is_first_microbatch`` attribute (Megatron-Core's FP8 weight
        cache refresh) when FP8 is on; the FP8 path here keeps no weight cache, so this only sets
        the flags."""
        if getattr(self.config, "fp8", None) is None:
            return
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True  # type: ignore[assignment]


def _convert(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, (tuple, list)):
        converted = [_convert(v, fn) for v in value]
        return tuple(converted) if isinstance(value, tuple) else converted
    return fn(value)


def fp32_to_float16(value: Any, float16_convertor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a tensor, or tuples / lists of them) with every fp32 tensor converted by
    ``float16_convertor``; other values (integer tensors, None) unchanged."""
    return _convert(
        value, lambda t: float16_convertor(t) if torch.is_tensor(t) and t.dtype == torch.float32 else t
    )


def float16_to_fp32(value: Any) -> Any:
    """``value`` with every fp16 / bf16 tensor converted to fp32; other values unchanged."""
    return _convert(
        value, lambda t: t.float() if torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16) else t
    )


class Float16Module(MegatronModule):
    """Wraps ``module`` (converted to fp16 or bf16 per ``config.fp16`` / ``config.bf16``) as
    ``self.module``. On the model's first stage (the module's ``pre_process``, True when it has none)
    fp32 tensor inputs are converted to the module's dtype; on its last stage (``post_process``)
    fp16 / bf16 outputs are converted to fp32 unless ``forward(..., fp32_output=False)``.

    Raises:
        ValueError: neither ``config.fp16`` nor ``config.bf16`` is set.
    """

    module: Any

    def __init__(self, config: Any, module: nn.Module):
        super().__init__(config)
        self.fp16, self.bf16 = config.fp16, config.bf16
        if self.fp16:
            self.add_module("module", module.half())
            self.float16_convertor = lambda t: t.half()
        elif self.bf16:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = lambda t: t.bfloat16()
        else:
            raise ConfigError(
                "Float16Module needs config.fp16=True or config.bf16=True", params=("fp16", "bf16")
            )

    def set_input_tensor(self, input_tensor: Any) -> Any:
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        if getattr(self.module, "pre_process", True):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if getattr(self.module, "post_process", True) and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(
        self,
        *args: Any,
        destination: Any = None,
        prefix: str = "",  # type: ignore[override]
        keep_vars: bool = False,
    ) -> Any:
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def shard_of(
    key: str, tensor: torch.Tensor, tp_rank: int, dp_rank: int, expt_dp_rank: int = 0
) -> ShardedTensor:
    """The ShardedTensor of one parameter. Stacked sub-tensors (SwiGLU's [gate; up], stride 2) are
    always stored as ``[stride, rows / stride, ...]``, whatever the tp size, so the shape a
    checkpoint records never depends on the layout.

    An expert parameter (``moe.expert_params``) is a block of the global ``[num_experts, ...]``
    tensor: dim 0 block ``ep_rank`` of ``ep_size``, its split dim block ``etp_rank`` of
    ``partition_size`` (stacked sub-tensors stored ``[..., stride, rows / stride, ...]`` as above),
    replicated over expert-dp (``expt_dp_rank``; ``tp_rank`` and ``dp_rank`` are not read) and, when
    not split, over expert-tp.
    """
    if getattr(tensor, "expert_parallel", False):
        return _expert_shard_of(key, tensor, expt_dp_rank)
    dim = getattr(tensor, "partition_dim", -1)
    parts = getattr(tensor, "partition_size", 1)
    stride = getattr(tensor, "partition_stride", 1)
    data = tensor
    if stride > 1:
        data = tensor.view(stride, tensor.shape[0] // stride, *tensor.shape[1:])
        dim += 1
    if dim < 0 or parts == 1:
        return ShardedTensor.from_rank_offsets(key, data, replica_id=(tp_rank, dp_rank))
    return ShardedTensor.from_rank_offsets(key, data, (dim, tp_rank, parts), replica_id=(0, dp_rank))


def _expert_shard_of(key: str, tensor: torch.Tensor, expt_dp_rank: int) -> ShardedTensor:
    dim = getattr(tensor, "partition_dim", -1)
    parts = getattr(tensor, "partition_size", 1) if dim >= 1 else 1
    stride = getattr(tensor, "partition_stride", 1)
    etp_rank: int = tensor.etp_rank  # type: ignore[attr-defined]
    data = tensor
    if stride > 1 and dim >= 1:
        shape = tuple(tensor.shape)
        data = tensor.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1 :])
        dim += 1
    offsets = [(0, tensor.ep_rank, tensor.ep_size)]  # type: ignore[attr-defined]
    if parts > 1:
        offsets.append((dim, etp_rank, parts))
    replica = (0 if parts > 1 else etp_rank, expt_dp_rank)
    return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=replica)
