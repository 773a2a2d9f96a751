"""Errors of checkpoints and sharded state dicts (not of the code): each message names the file,
directory or key.

All are ``ValueError`` subclasses, so that an application that prints user errors as one line (as
``pretrain_gpt.py`` does) prints these too, and ``CheckpointingException`` subclasses, so that code
written for Megatron-Core's ``except CheckpointingException`` catches them; anything else a save or
load raises is a bug and keeps its traceback.
"""

from megatron.core.dist_checkpointing.core import CheckpointingException


class CheckpointError(CheckpointingException, ValueError):
    """A checkpoint cannot be saved or loaded as asked: sharding, key, shape or format problems."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint file could not be written: disk full, quota, permissions, an I/O error.

    ``directory`` is the checkpoint (or save) directory, ``reason`` the OS error with the file it names.
    """

    def __init__(self, directory: str, reason: str) -> None:
        super().__init__(directory, reason)
        self.directory, self.reason = directory, reason

    def __str__(self) -> str:
        return f"cannot write checkpoint {self.directory}: {self.reason}"


class CheckpointReadError(CheckpointError):
    """A checkpoint to load is damaged: a file missing, truncated or unreadable."""
