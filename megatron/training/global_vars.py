"""Megatron-LM's process-wide argument holder, for tools written against it (``get_args()`` after
``set_args(validate_args(parse_args()))``). This package's own code never reads it: the run's
configs are passed explicitly."""

from __future__ import annotations

import argparse

_ARGS: argparse.Namespace | None = None


def set_args(args: argparse.Namespace | None) -> None:
    """Record ``args`` as the process's arguments (None forgets them)."""
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The recorded arguments; AssertionError ``args is not initialized.`` before ``set_args``, as in Megatron-LM."""
    assert _ARGS is not None, "args is not initialized."
    return _ARGS


def unset_global_variables() -> None:
    """Forget the recorded arguments (between runs in one process)."""
    set_args(None)
