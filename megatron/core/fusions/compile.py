"""torch.compile where it pays, chosen by the caller.

Two uses: small elementwise helpers (:class:`MaybeCompiled`, compiled on first use with CUDA
tensors when the caller asks for it) and whole transformer layers (:func:`compile_layers`,
``nn.Module.compile`` so parameter names and checkpoints are unchanged). Every layer of a model
shares one compiled graph: the layers have the same code and shapes, and parameters are graph inputs.
Whether a run compiles is the execution plan's decision, made once at start-up; CPU runs stay eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class MaybeCompiled:
    """``fn`` and its ``torch.compile(dynamic=dynamic)`` form: ``self(*args, compile=...)`` runs the
    compiled one when ``compile`` (the caller's choice, from the execution plan) is true and the first
    argument is a CUDA tensor, ``fn`` otherwise. ``dynamic=True`` suits helpers called on many shapes
    (one graph for all). The compiled wrapper is made on the first compiled call (torch.compile itself
    compiles lazily, per shape)."""

    def __init__(self, fn: Callable[..., Any], dynamic: bool = False) -> None:
        self.fn = fn
        self.dynamic = dynamic
        self._compiled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, compile: bool) -> Any:
        if not (compile and args[0].is_cuda):
            return self.fn(*args)
        if self._compiled is None:
            raise_recompile_limits()
            self._compiled = torch.compile(self.fn, dynamic=self.dynamic)
        return self._compiled(*args)


def maybe_compiled(fn: Callable[..., Any] | None = None, *, dynamic: bool = False) -> Any:
    """Decorator form of :class:`MaybeCompiled` (``@maybe_compiled`` or ``@maybe_compiled(dynamic=True)``)."""
    if fn is None:
        return functools.partial(MaybeCompiled, dynamic=dynamic)
    return MaybeCompiled(fn, dynamic=dynamic)


def raise_recompile_limits() -> None:
    """Room for one graph per tensor size (static-shape helpers) and per layer variant, so nothing
    silently falls back to eager after dynamo's default of 8; compiler failures fall back to eager
    for that frame with a warning. (These are torch's process-wide dynamo settings.)"""
    cfg = torch._dynamo.config  # torch imports dynamo (seconds) on this first access: runs that compile
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    cfg.suppress_errors = True
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)


def compile_layers(modules: Sequence[nn.Module], layer_type: type) -> int:
    """``module.compile(dynamic=False)`` for every ``layer_type`` submodule; returns how many.

    Raises dynamo's recompile limit so that no layer silently falls back to eager when guards
    differ between layers (they should not: all layers share one graph). The Triton kernels the
    layers call were chosen, by their self-checks, before the model was built (the execution plan).
    """
    layers = [m for root in modules for m in root.modules() if isinstance(m, layer_type)]
    if not layers:
        return 0
    raise_recompile_limits()
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)
