"""Megatron-Core: the library (no argparse, no global args). Importing it imports no torch.

The names Megatron-Core's package exposes (``parallel_state`` and its legacy alias ``mpu``,
``tensor_parallel``, ``utils``, ``dist_checkpointing``, ``DistributedDataParallel``,
``ModelParallelConfig``, ``__version__``) are loaded on first access (PEP 562).
``__version__`` is the Megatron-Core release whose API this package provides.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.19.2"
__shortversion__ = "0.19.2"

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "parallel_state": ("megatron.core.parallel_state", None),
    "mpu": ("megatron.core.parallel_state", None),
    "tensor_parallel": ("megatron.core.tensor_parallel", None),
    "utils": ("megatron.core.utils", None),
    "dist_checkpointing": ("megatron.core.dist_checkpointing", None),
    "DistributedDataParallel": ("megatron.core.distributed", "DistributedDataParallel"),
    "ModelParallelConfig": ("megatron.core.model_parallel_config", "ModelParallelConfig"),
    "is_torch_min_version": ("megatron.core.utils", "is_torch_min_version"),
}

__all__ = [
    "parallel_state",
    "tensor_parallel",
    "utils",
    "DistributedDataParallel",
    "ModelParallelConfig",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
