"""Placeholders a spec names where a submodule is left out: ``IdentityOp()(x) is x``."""

from __future__ import annotations

from typing import Any

from torch import nn


class IdentityOp(nn.Module):
    """Takes any constructor arguments; ``forward(x, ...)`` returns ``x``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class IdentityFuncOp(IdentityOp):
    """``IdentityFuncOp()(...)`` is a function that returns its first argument (for specs whose
    entry is called to obtain a function, such as a bias-dropout-add)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward
