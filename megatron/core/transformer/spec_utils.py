"""Layer specs: which class builds each submodule, so variants swap classes without touching forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModuleSpec:
    """A module class plus the specs or classes of its submodules and extra constructor kwargs."""

    module: type
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(spec_or_cls, *args, **kwargs):
    """Instantiate a ``ModuleSpec`` (passing its ``submodules`` and ``params``) or a plain class."""
    if spec_or_cls is None:
        return None
    if isinstance(spec_or_cls, ModuleSpec):
        extra = dict(spec_or_cls.params)
        extra.update(kwargs)
        if spec_or_cls.submodules is not None:
            extra["submodules"] = spec_or_cls.submodules
        return spec_or_cls.module(*args, **extra)
    return spec_or_cls(*args, **kwargs)
