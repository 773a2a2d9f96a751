"""The error of data files: missing, corrupt, or not matching the run."""

from __future__ import annotations

from collections.abc import Sequence


class DataError(ValueError):
    """A data file, its index, checksum record or index cache cannot be used as asked; the message
    names the file and what to do (write it again, delete a cache, give a larger split).

    A ``ValueError`` subclass, so that code catching ``ValueError`` around dataset building still
    catches it; an application reports it as a user error (``megatron.training.user_errors``).

    Args:
        message: what is wrong with which file, and what to do.
        params: the config parameters the message names (as ``ConfigError.params``), if any.
    """

    def __init__(self, message: str, *, params: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.params: tuple[str, ...] = tuple(params)
