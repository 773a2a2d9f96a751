"""torch.compile where it pays, with an eager fallback that computes the same thing.

Two uses: small elementwise helpers (:func:`maybe_compiled`, compiled on first use with CUDA
tensors) and whole transformer layers (:func:`compile_layers`, ``nn.Module.compile`` so parameter
names and checkpoints are unchanged). Every layer of a model shares one compiled graph: the layers
have the same code and shapes, and parameters are graph inputs. CPU runs (and CI) stay eager.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

_STATE = {"enabled": True}


def set_compile_enabled(enabled: bool) -> None:
    """Allow (default) or forbid compilation of the fused helpers; set once at start-up."""
    _STATE["enabled"] = enabled


def compile_enabled() -> bool:
    return _STATE["enabled"]


def maybe_compiled(fn=None, *, dynamic: bool = False):
    """``fn`` compiled with ``torch.compile(dynamic=dynamic)`` when its first tensor argument is on
    CUDA and compilation is enabled; ``fn`` itself otherwise, or after a compilation error.
    ``dynamic=True`` suits helpers called on many shapes (one graph for all)."""
    if fn is None:
        return functools.partial(maybe_compiled, dynamic=dynamic)
    compiled = {"fn": None, "failed": False}

    @functools.wraps(fn)
    def wrapper(*args):
        if not (_STATE["enabled"] and args[0].is_cuda) or compiled["failed"]:
            return fn(*args)
        if compiled["fn"] is None:
            _raise_recompile_limits()
            compiled["fn"] = torch.compile(fn, dynamic=dynamic)
        try:
            return compiled["fn"](*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back, say so once
            compiled["failed"] = True
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(exc).__name__}: {exc}); running eagerly",
                          stacklevel=2)
            return fn(*args)

    return wrapper


def _raise_recompile_limits() -> None:
    """Room for one graph per tensor size (static-shape helpers) and per layer variant, so nothing
    silently falls back to eager after dynamo's default of 8; compiler failures fall back to eager
    for that frame with a warning."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    cfg.suppress_errors = True
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)


def compile_layers(modules: list[nn.Module], layer_type: type) -> int:
    """``module.compile(dynamic=False)`` for every ``layer_type`` submodule; returns how many.

    Raises dynamo's recompile limit so that no layer silently falls back to eager when guards
    differ between layers (they should not: all layers share one graph).
    """
    layers = [m for root in modules for m in root.modules() if isinstance(m, layer_type)]
    if not layers:
        return 0
    _raise_recompile_limits()
    param = next(layers[0].parameters(), None)
    if param is not None and param.is_cuda:
        from megatron.core.fusions.triton_kernels import prepare_kernels

        prepare_kernels(param.device)  # the Triton kernels the layers call: self-checked before tracing
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)
