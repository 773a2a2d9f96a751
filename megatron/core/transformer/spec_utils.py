"""Layer specs (Megatron-Core's spec utilities): which class builds each submodule, so that variants
swap classes without touching ``forward``.

A spec's ``module`` is a class, a function, or a ``(module_path, name)`` pair imported when the spec
is built. Building a spec (or a class) calls it with the spec's ``params`` and ``submodules`` plus
the caller's arguments; a function (given directly or as a spec's module) is returned unchanged,
never called: specs name functions such as the bias-dropout-add that their owner calls later.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class ModuleSpec:
    """A module (class, function or ``(module_path, name)``), the ``params`` passed to its constructor,
    the ``submodules`` it builds its children from, and free-form ``metainfo``. Calling the spec
    builds it (:func:`build_module`)."""

    module: Any
    params: dict = field(default_factory=dict)
    submodules: Any = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def import_module(module_path: tuple[str, str]) -> Any:
    """The object ``name`` of the module ``path`` for ``module_path = (path, name)``; ``None`` (with
    an error logged) when the module cannot be imported, as in Megatron-Core.

    Raises:
        AttributeError: the module imports but has no ``name``.
    """
    base_path, name = module_path
    try:
        module = importlib.import_module(base_path)
    except ImportError as e:
        logger.error("could not import %s: %s", base_path, e)
        return None
    return getattr(module, name)


def _is_function(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType)


def get_module(spec_or_module: Any, **additional_kwargs: Any) -> Any:
    """The class or function a spec (or a class / function itself) names, imported if it is a
    ``(module_path, name)`` pair; nothing is built."""
    if isinstance(spec_or_module, type) or _is_function(spec_or_module):
        return spec_or_module
    module = spec_or_module.module
    if isinstance(module, type) or _is_function(module):
        return module
    return import_module(module)


def build_module(spec_or_module: Any, *args: Any, **kwargs: Any) -> Any:
    """Build a spec or class: ``module(*args, **spec.params, **kwargs, submodules=spec.submodules)``
    (``submodules`` only when the spec has some; a keyword given both in ``params`` and by the caller
    takes the caller's value). A function, given directly or as the spec's module (also once
    imported), is returned unchanged. A ``functools.partial`` (Megatron-Core's builder form, e.g.
    ``partial(MLP, submodules=...)``) is called with the arguments. ``None`` builds nothing.

    Raises:
        ImportError: a ``(module_path, name)`` module that cannot be imported.
        Exception: the constructor's own error, re-raised with the name of the module it came from.
    """
    if spec_or_module is None:
        return None
    if _is_function(spec_or_module):
        return spec_or_module
    if isinstance(spec_or_module, functools.partial):
        return spec_or_module(*args, **kwargs)
    if isinstance(spec_or_module, type):
        module, params, submodules = spec_or_module, {}, None
    else:
        module, params = get_module(spec_or_module), dict(spec_or_module.params)
        submodules = spec_or_module.submodules
        if module is None:
            raise ImportError(f"ModuleSpec module {spec_or_module.module!r} could not be imported")
    if _is_function(module):
        return module
    params.update(kwargs)
    if submodules is not None:
        params["submodules"] = submodules
    try:
        return module(*args, **params)
    except Exception as e:
        if getattr(e, "_module_named", False):
            raise
        try:
            wrapped = type(e)(f"{e} when instantiating {getattr(module, '__name__', module)}")
        except Exception:
            raise e from None  # an exception type that takes other arguments keeps its own message
        wrapped._module_named = True  # type: ignore[attr-defined]
        raise wrapped.with_traceback(e.__traceback__) from None


def get_submodules(spec: Any) -> Any:
    """The ``submodules`` of a spec, of a ``functools.partial`` (its ``submodules`` keyword) or of any
    object with that attribute.

    Raises:
        ValueError: ``spec`` has no submodules.
    """
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    if hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"Could not find `submodules` in the provided spec: {spec!r}")


def accepts_keyword(spec_or_module: Any, name: str) -> bool:
    """Whether building ``spec_or_module`` (a class, ``ModuleSpec`` or ``functools.partial``) takes the
    keyword ``name`` (by name, or through ``**kwargs``)."""
    target = spec_or_module
    if isinstance(target, functools.partial):
        target = target.func
    elif not isinstance(target, type) and hasattr(target, "module"):
        target = get_module(target)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
