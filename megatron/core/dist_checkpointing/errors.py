"""Errors of the checkpoint files themselves (not of the code): each message is one line that names the
file or directory and the operating system's error.

Both are ``ValueError`` subclasses, so that an application that prints user errors as one line (as
``pretrain_gpt.py`` does) prints these too; anything else a save or load raises is a bug and keeps its
traceback.
"""


class CheckpointWriteError(ValueError):
    """A checkpoint file could not be written: disk full, quota, permissions, an I/O error.

    ``directory`` is the checkpoint (or save) directory, ``reason`` the OS error with the file it names.
    """

    def __init__(self, directory: str, reason: str) -> None:
        super().__init__(directory, reason)
        self.directory, self.reason = directory, reason

    def __str__(self) -> str:
        return f"cannot write checkpoint {self.directory}: {self.reason}"


class CheckpointReadError(ValueError):
    """A checkpoint to load is damaged: a file missing, truncated or unreadable."""
