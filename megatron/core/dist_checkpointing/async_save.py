"""Asynchronous ``torch_dist`` saves: the state is staged to host memory, DCP writes it in a thread.

    writer = AsyncWriter()                     # collective: creates the writer's gloo group
    pending = writer.start(sharded_state_dict, checkpoint_dir, common_state=common)
    ...                                        # training goes on; the staged copy is what is written
    if pending.done():
        pending.result()                       # raises CheckpointWriteError; metadata.json written
    writer.close()

``start`` runs in the calling thread what a synchronous save runs before writing (the sharding and key
checks, collective over ``process_group``), then stages this rank's blocks and objects with torch DCP's
``DefaultStager`` (pinned host buffers on CUDA, allocated at the first save and reused by every later
one; non-blocking copies and one device synchronisation) and hands the staged copy to
``torch.distributed.checkpoint.async_save``, whose thread runs DCP's plan, write and finish over the
writer's own gloo group: nothing of it shares a communicator with training. DCP's last step gathers every
rank's write results on rank 0 before it returns there, so ``result()`` on rank 0 knows that every rank
has finished and writes ``metadata.json`` (the completion marker, last, as a synchronous save does).

One write is in flight at a time: the staged buffers are reused, so ``start`` refuses to run while the
previous write has not been collected with ``result()``.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from megatron.core.dist_checkpointing import files
from megatron.core.dist_checkpointing.errors import CheckpointWriteError
from megatron.core.dist_checkpointing.files import group_rank
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.sharded_io import prepare_write
from megatron.core.dist_checkpointing.torch_dist import _BlockSavePlanner, _reraise, _writer, save_state


def _staging_options() -> StagingOptions:
    """Pinned buffers and non-blocking copies where there is a GPU; plain host copies otherwise."""
    cuda = torch.cuda.is_available()
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


class PendingWrite:
    """One checkpoint being written in the background (``AsyncWriter.start``)."""

    def __init__(self, checkpoint_dir: str, future: Future, staged_s: float, process_group: Any) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.staged_s = staged_s  # seconds ``start`` took: what the caller was blocked for
        self.started = time.monotonic()
        self._future = future
        self._process_group = process_group
        self._collected = False

    def done(self) -> bool:
        """This rank's write has finished (successfully or not); never blocks."""
        return self._future.done()

    def wait(self) -> None:
        """Block until this rank's write has finished; its outcome is ``result()``'s."""
        wait([self._future])

    def result(self) -> float:
        """Wait for this rank's write; on rank 0 then write ``metadata.json``. Returns the seconds from
        ``start`` to completion. Not collective: rank 0's write ends only once every rank's has.

        Raises:
            CheckpointWriteError: a file could not be written on some rank (on every rank, the same), or
                ``metadata.json`` could not be written (rank 0). Nothing is removed.
        """
        self._collected = True
        with _reraise(
            f"writing checkpoint {self.checkpoint_dir}",
            lambda reason: CheckpointWriteError(self.checkpoint_dir, reason),
        ):
            self._future.result()
        if group_rank(self._process_group) == 0:
            files.write_metadata_json(self.checkpoint_dir)
        return time.monotonic() - self.started

    @property
    def collected(self) -> bool:
        return self._collected


class AsyncWriter:
    """Starts background writes of sharded state dicts, one at a time, reusing the staged buffers.

    Collective when distributed: every rank constructs it at the same point (it creates the gloo group
    that its writes' DCP collectives use, over all ranks of the default group).

    Args:
        timeout: how long a write's collectives wait for the slowest rank (its writes included).
        process_group: the group that ``start``'s checks run over (the callers' group; None: default).
    """

    def __init__(self, timeout: timedelta = timedelta(minutes=30), process_group: Any = None) -> None:
        self._process_group = process_group
        self._write_group = (
            dist.new_group(backend="gloo", timeout=timeout)
            if dist.is_available() and dist.is_initialized()
            else None
        )
        self._stager = DefaultStager(_staging_options())
        self._pending: PendingWrite | None = None

    def start(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        *,
        common_state: dict | None = None,
        validate_access_integrity: bool = True,
    ) -> PendingWrite:
        """Collectively check the state dict (as ``dist_checkpointing.save`` does), stage this rank's part
        and start writing it to ``checkpoint_dir`` in the background; return once the staged copy is
        complete (the original tensors may then change).

        Raises:
            CheckpointError: a sharding, shape or key problem (on every rank, before anything is written).
            CheckpointWriteError: the directory cannot be created.
            RuntimeError: the previous write was not collected with ``result()``.
        """
        if self._pending is not None and not self._pending.collected:
            raise RuntimeError(
                f"the write of {self._pending.checkpoint_dir} is still pending: call result() first"
            )
        t0 = time.monotonic()
        tensors, objects = prepare_write(
            sharded_state_dict,
            checkpoint_dir,
            validate_access_integrity=validate_access_integrity,
            common_state=common_state,
            process_group=self._process_group,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            future = dcp.async_save(
                save_state(tensors, objects),
                storage_writer=_writer(checkpoint_dir),
                planner=_BlockSavePlanner(tensors, list(objects)),
                process_group=self._write_group,
                async_stager=self._stager,
                no_dist=self._write_group is None,
            )
        assert isinstance(future, Future), type(future)  # staging is synchronous: no AsyncSaveResponse
        self._pending = PendingWrite(checkpoint_dir, future, time.monotonic() - t0, self._write_group)
        return self._pending

    def close(self) -> None:
        """Wait for a write in flight (its errors are the caller's to collect), free the staged buffers."""
        if self._pending is not None and not self._pending.collected:
            self._pending.wait()
        self._stager.close()
        if self._write_group is not None:
            dist.destroy_process_group(self._write_group)
            self._write_group = None


__all__ = ["AsyncWriter", "PendingWrite"]
