"""Data that fails mid-run: a DataLoader worker that dies, a data file that changes or becomes unreadable.

The dataset raises ``DataError`` naming the file and the sample (``IndexedDataset.get`` checks, per
read, that the file under its memory map still holds the bytes: a mapped page past the end of a file
truncated meanwhile would kill the process with SIGBUS). A DataLoader worker hands that error to the
main process wrapped in its own traceback text, and a worker that died (the out-of-memory killer, a
``kill -9``) becomes a ``RuntimeError``. :class:`FaultNamingIterator` turns both into one
``DataError`` line that also says which step's micro-batch was being loaded; the trainer then saves a
checkpoint of the last complete step where it can (one process: no other rank is waiting inside the
step) and the run stops with exit code 2 (``megatron.training.cli``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from megatron.core.datasets.errors import DataError
from megatron.training.loop_utils import wrap_each_iterator

_WORKER_DIED = "DataLoader worker"  # torch's text for a worker that exited or was killed


class DataFault(DataError):
    """A data failure during training, already phrased for the user (one line)."""


def _last_line(error: BaseException) -> str:
    """The error's own message: a worker's re-raised error carries the worker's traceback text, whose
    last line is ``module.DataError: <message>``."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    last = lines[-1] if lines else type(error).__name__
    for prefix in ("megatron.core.datasets.errors.DataError: ", "DataError: "):
        if last.startswith(prefix):
            return last[len(prefix) :]
    return last


class FaultNamingIterator:
    """Wraps one training data iterator; ``where()`` says which step's micro-batch is being loaded."""

    def __init__(self, live: Iterator, where: Callable[[], str]) -> None:
        self.live, self.where = live, where

    def __iter__(self) -> FaultNamingIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.live)
        except StopIteration:
            raise
        except DataError as e:
            self._stop_workers()
            raise DataFault(f"{_last_line(e)}, loading {self.where()}") from None
        except RuntimeError as e:
            if _WORKER_DIED not in str(e):
                raise
            self._stop_workers()
            raise DataFault(
                f"a DataLoader worker died while loading {self.where()} ({_last_line(e).rstrip('. ')}; the "
                "kernel's out-of-memory killer ends workers this way: see dmesg, or lower --num-workers)"
            ) from None

    def _stop_workers(self) -> None:
        """Shut the loader's workers down now: torch's SIGCHLD handler would otherwise raise the dead
        worker's error again later, wherever the process then is."""
        stop = getattr(self.live, "_shutdown_workers", None)
        if stop is not None:
            stop()


def name_data_faults(iterators: Any, where: Callable[[], str]) -> Any:
    """The per-chunk list of training iterators (entries possibly shared or None), each wrapped once."""
    return wrap_each_iterator(iterators, lambda it, _: FaultNamingIterator(it, where))
