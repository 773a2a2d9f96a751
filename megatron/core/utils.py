"""Megatron-Core's ``megatron.core.utils``: the helpers its users' training loops import.

Version checks (``is_torch_min_version``, ``is_te_min_version``: False without Transformer
Engine, whose version then reads 0.0.0), model unwrapping (``unwrap_model`` sees through our
DistributedDataParallel and ``megatron.core.transformer.module.Float16Module``), the
``get_model_config`` family, process-group helpers, viewless tensors, init methods and logging.
Importing it imports torch but builds no groups.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron.core.logging_utils import log_single_rank
from megatron.core.runtime import GlobalMemoryBuffer, get_runtime
from megatron.core.transformer.context_parallel.layout import get_batch_on_this_cp_rank
from megatron.core.transformer.module import Float16Module

try:
    from packaging.version import Version
except ImportError:  # torch vendors the same module
    from torch._vendor.packaging.version import Version  # type: ignore[no-redef,assignment]

# Megatron-Core's names here, defined with the runtime state, the data pipeline's logging and the
# context-parallel layout.
__all__ = ["GlobalMemoryBuffer", "get_batch_on_this_cp_rank", "log_single_rank"]


# --- versions -----------------------------------------------------------------------------------
def get_torch_version() -> Version:
    """The installed torch's version."""
    return Version(torch.__version__)


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """torch >= ``version`` (> with ``check_equality=False``)."""
    return (
        get_torch_version() >= Version(version) if check_equality else get_torch_version() > Version(version)
    )


def get_te_version() -> Version:
    """Transformer Engine's version; ``0.0.0`` when it is not installed (as Megatron-Core reports).
    Probed once per process (the runtime state keeps it)."""
    runtime = get_runtime()
    if runtime.te_version is None:
        try:
            import transformer_engine as te  # type: ignore[import-not-found]

            runtime.te_version = Version(str(getattr(te, "__version__", "0.0.0")))
        except ImportError:
            runtime.te_version = Version("0.0.0")
    return runtime.te_version


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Transformer Engine >= ``version`` (> with ``check_equality=False``); False without TE."""
    return get_te_version() >= Version(version) if check_equality else get_te_version() > Version(version)


# --- arithmetic ---------------------------------------------------------------------------------
def ensure_divisibility(numerator: int, denominator: int) -> None:
    """AssertionError unless ``denominator`` divides ``numerator``."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, asserting it divides exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def accepts_parameter(func: Callable, name: str) -> bool:
    """``func`` takes a parameter ``name`` (or ``**kwargs``)."""
    params = inspect.signature(func).parameters.values()
    return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


# --- process groups -----------------------------------------------------------------------------
def get_tensor_model_parallel_group_if_none(
    tp_group: Any, is_expert: bool = False, check_initialized: bool = True
) -> Any:
    """``tp_group``, or parallel_state's (expert) tensor-parallel group when it is None.

    None when torch.distributed is not initialised; ``tp_group`` unchanged before
    ``initialize_model_parallel``. Falling back warns (DeprecationWarning, rank 0), as in Megatron-Core.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if dist.get_rank() == 0:
        warnings.warn(
            "tp_group is None: using parallel_state's tensor-parallel group; pass the group",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_pg_size(group: Any = None) -> int:
    """``group.size()``; 1 when ``group`` is None or torch.distributed is not initialised."""
    return 1 if group is None or not dist.is_initialized() else group.size()


def get_pg_rank(group: Any = None) -> int:
    """``group.rank()``; 0 when ``group`` is None or torch.distributed is not initialised."""
    return 0 if group is None or not dist.is_initialized() else group.rank()


def get_pg_src_rank(group: Any = None) -> int:
    """The global rank of ``group``'s rank 0 (0 when None or not initialised)."""
    return 0 if group is None or not dist.is_initialized() else dist.get_process_group_ranks(group)[0]


# --- wrapped models -----------------------------------------------------------------------------
def get_attr_wrapped_model(
    model: Any, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """``attr`` of the first of ``model``, ``model.module``, ``model.module.module``, ... having it
    (with ``allow_none=False``: having it not None); that object itself with ``return_model_obj``.

    Raises:
        RuntimeError: ``model`` is a list, or no wrapper level has the attribute.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model takes one model, not a list of model chunks")

    def missing(m: Any) -> bool:
        return not hasattr(m, attr) if allow_none else getattr(m, attr, None) is None

    while missing(model):
        if not hasattr(model, "module"):
            raise RuntimeError(f"get_attr_wrapped_model couldn't find attribute {attr}")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_model_type(model: Any) -> Any:
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model: Any) -> bool:
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def get_model_config(model: Any) -> Any:
    """The ``config`` of a model or of the model inside its wrappers (never None)."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model: Any, module_instances: Any = None) -> Any:
    """The model inside DDP / FSDP2 / Float16Module wrappers (or ``module_instances``); a list maps to a list."""
    default = (DistributedDataParallel, TorchFullyShardedDataParallel, Float16Module)
    wrappers: Any = default if module_instances is None else module_instances
    models: list[Any] = model if isinstance(model, list) else [model]
    out = []
    for m in models:
        while isinstance(m, wrappers):
            m = m.module
        out.append(m)
    return out if isinstance(model, list) else out[0]


def is_submodule(module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True) -> bool:
    """``module`` is among ``parent_module.modules()`` (and, when ``strict``, not the parent itself)."""
    if strict and module is parent_module:
        return False
    return any(m is module for m in parent_module.modules())


# --- tensors ------------------------------------------------------------------------------------
class WrappedTensor:
    """Holds a tensor so that the callee can drop the last reference: :meth:`unwrap` once."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._wrapper = [tensor]

    def unwrap(self) -> torch.Tensor:
        if not self._wrapper:
            raise RuntimeError("WrappedTensor has already been unwrapped")
        return self._wrapper.pop(0)


def _viewless(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Forward: a tensor sharing ``inp``'s data without its ``._base``; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return _viewless(inp, requires_grad)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """``inp`` itself when it is not a view; else a tensor with its data and no ``._base`` (kept in
    the autograd graph when ``keep_graph``), so the viewed tensor can be freed."""
    if inp._base is None:
        return inp
    return MakeViewlessTensor.apply(inp, requires_grad) if keep_graph else _viewless(inp, requires_grad)


def assert_viewless_tensor(tensor: Any, extra_msg: str | None = None) -> Any:
    """AssertionError when ``tensor`` (or one in a list) is a view; returns it unchanged."""
    if isinstance(tensor, list):
        for t in tensor:
            assert_viewless_tensor(t, extra_msg)
        return tensor
    if isinstance(tensor, torch.Tensor):
        assert tensor._base is None, (
            f"tensor is a view (its ._base is set): it would keep the viewed memory. {extra_msg}"
        )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    assert_viewless_tensor(tensor, extra_msg=f"new data has shape {tuple(new_data_tensor.shape)}")
    tensor.data = new_data_tensor


def to_local_if_dtensor(tensor: Any) -> Any:
    """The local shard of a DTensor; any other tensor unchanged."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- init methods -------------------------------------------------------------------------------
def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """In-place N(0, sigma) init."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """In-place N(0, sigma / sqrt(multiplier * num_layers)) init (output projections)."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma / math.sqrt(multiplier * num_layers))


def mup_scaled_init_method_normal(
    sigma: float, num_layers: int, width_mult: float, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """In-place N(0, sigma / (sqrt(multiplier * num_layers) * sqrt(width_mult))) init."""
    std = sigma / (math.sqrt(multiplier * num_layers) * math.sqrt(width_mult))
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


# --- logging ------------------------------------------------------------------------------------
def log_on_each_pipeline_stage(
    logger: logging.Logger, *args: Any, tp_group: Any = None, dp_cp_group: Any = None, **kwargs: Any
) -> None:
    """Log on tensor-parallel rank 0 and data x context rank 0 of each pipeline stage.

    Both groups, or neither (then parallel_state's), must be given.
    """
    if (tp_group is None) != (dp_cp_group is None):
        raise ValueError("tp_group and dp_cp_group must be provided or not provided together")
    if tp_group is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_cp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    else:
        tp_rank, dp_cp_rank = tp_group.rank(), dp_cp_group.rank()
    if tp_rank == 0 and dp_cp_rank == 0:
        logger.log(*args, **kwargs)


# --- NVTX ---------------------------------------------------------------------------------------
def configure_nvtx_profiling(enabled: bool) -> None:
    """Turn the NVTX ranges of :func:`nvtx_range_push` / :func:`nvtx_range_pop` on or off (for the
    process: the runtime state keeps the setting)."""
    get_runtime().nvtx_enabled = enabled


def nvtx_range_push(msg: str | None = None, suffix: str | None = None) -> None:
    """Open an NVTX range (when enabled and CUDA is present; otherwise nothing)."""
    if get_runtime().nvtx_enabled and torch.cuda.is_available():
        torch.cuda.nvtx.range_push(f"{msg or ''}{'.' + suffix if suffix else ''}")


def nvtx_range_pop(msg: str | None = None, suffix: str | None = None) -> None:
    if get_runtime().nvtx_enabled and torch.cuda.is_available():
        torch.cuda.nvtx.range_pop()


def nvtx_decorator(message: str | None = None) -> Callable[[Callable], Callable]:
    """Wrap a function in an NVTX range named ``message`` (default: its qualified name)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nvtx_range_push(message or fn.__qualname__)
            try:
                return fn(*args, **kwargs)
            finally:
                nvtx_range_pop(message or fn.__qualname__)

        return wrapper

    return decorate
