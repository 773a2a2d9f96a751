"""Helpers for typed, self-documenting config dataclasses.

Every config field carries its documentation in ``metadata["help"]``; the command-line parser in
``megatron.training.arguments`` is generated from these fields, so the flag list, ``--help`` text
and the field docs can never drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A user's mistake in a config: the message names the parameter and a value that would be valid.

    In the library the message names each parameter as the config dataclass spells it
    (``tensor_model_parallel_size``); ``params`` lists the names the message mentions, so that the
    training application can rewrite them to its command-line flags
    (``megatron.training.cli.flag_message``) while library users read the field names.

    Args:
        message: the one-line explanation: what is wrong and a value that would be valid.
        params: the parameter names (config field names) the message mentions, in any order.
    """

    def __init__(self, message: str, *, params: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.params: tuple[str, ...] = tuple(params)


def doc(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = "",
    choices: Sequence[Any] | None = None,
    nargs: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    metavar: str | None = None,
    app_default: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with documentation and command-line metadata.

    Args:
        default: the default value.
        help: the field's documentation (unit, default, when it has no effect).
        flag: the command-line flag; ``""`` derives ``--field-name`` from the field name, ``None``
            means the field is not a flag (it is derived from other flags or set in code).
        choices: the valid values, checked by the parser.
        nargs: argparse ``nargs`` for list-valued fields.
        app_default: the training application's default when it differs from the library's
            ``default`` (Megatron-LM's flag default versus Megatron-Core's field default); the
            parser uses it when the flag is not given (:func:`flag_default`).
    """
    meta: dict[str, Any] = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "nargs": nargs,
        "metavar": metavar,
    }
    if app_default is not dataclasses.MISSING:
        meta["app_default"] = app_default
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_default(f: dataclasses.Field[Any]) -> Any:
    """The value a field takes in the training application when its flag is not given: its
    ``app_default`` if it has one, else the dataclass default (``MISSING`` when it has none)."""
    if "app_default" in f.metadata:
        return f.metadata["app_default"]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def check_choice(name: str, value: Any, valid: Sequence[Any]) -> None:
    """Raise a ``ConfigError`` naming the field ``name`` and the valid values unless ``value`` is one."""
    if value not in valid:
        raise ConfigError(f"{name} {value!r} is not valid; choose one of {list(valid)}", params=(name,))


def check_positive(
    name: str, value: float | int | None, allow_none: bool = False, allow_zero: bool = False
) -> None:
    """Raise a ``ConfigError`` naming the field ``name`` unless ``value`` is > 0 (>= 0 with
    ``allow_zero``; None passes with ``allow_none``)."""
    if value is None and allow_none:
        return
    if value is None or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound}, got {value}", params=(name,))
