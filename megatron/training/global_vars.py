"""Megatron-LM's process-wide argument holder, for tools written against it (``get_args()`` after
``set_args(validate_args(parse_args()))``). This package's own code never reads it: the run's
configs are passed explicitly.

The arguments live in the application's state (:class:`AppState`), which the runtime state holds
(``megatron.core.runtime.Runtime.app``) so that the library never imports the application.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.core.runtime import get_runtime

if TYPE_CHECKING:  # annotation only: initialize imports this module
    from megatron.training.initialize import ErrorChannel


@dataclass
class AppState:
    """The training application's process-wide state.

    Attributes:
        args: Megatron-LM's argument namespace recorded by :func:`set_args` (None: not recorded).
        channel: the job's error channel (``megatron.training.initialize``), started under torchrun
            with several ranks; None otherwise.
    """

    args: argparse.Namespace | None = None
    channel: ErrorChannel | None = None


def app_state() -> AppState:
    """The application's state in the runtime, made on first use."""
    runtime = get_runtime()
    if not isinstance(runtime.app, AppState):
        runtime.app = AppState()
    return runtime.app


def set_args(args: argparse.Namespace | None) -> None:
    """Record ``args`` as the process's arguments (None forgets them)."""
    app_state().args = args


def get_args() -> argparse.Namespace:
    """The recorded arguments; AssertionError ``args is not initialized.`` before ``set_args``, as in Megatron-LM."""
    args = app_state().args
    assert args is not None, "args is not initialized."
    return args


def unset_global_variables() -> None:
    """Forget the recorded arguments (between runs in one process)."""
    set_args(None)
