"""Asynchronous ``torch_dist`` saves: the state is staged to host memory, DCP writes it in a thread.

    writer = AsyncWriter()                     # collective: creates the writer's gloo group
    pending = writer.start(sharded_state_dict, checkpoint_dir, common_state=common)
    ...                                        # training goes on; the staged copy is what is written
    if pending.done():
        pending.result()                       # raises CheckpointWriteError; metadata.json written
    writer.close()

``start`` runs in the calling thread what a synchronous save runs before writing (the sharding and key
checks, collective over ``process_group``; the objects pickled), then hands this rank's blocks to
``torch.distributed.checkpoint.async_save`` with ``HostStager``, DCP's ``AsyncStager`` protocol: the
blocks are copied into host buffers of exactly their sizes (one page-locked region on CUDA), allocated
at the first save and reused by every later one of the same layout, with non-blocking copies and one
device synchronisation. DCP's thread then runs its plan, write and finish over the writer's own gloo
group: nothing of it shares a communicator with training. (torch's ``DefaultStager`` copies whole
storages, which for a block that is a view of a larger buffer is more than the block, and in torch 2.11
cannot stage twice: pytorch/pytorch#183413.) DCP's last step gathers every
rank's write results on rank 0 before it returns there, so ``result()`` on rank 0 knows that every rank
has finished and writes ``metadata.json`` (the completion marker, last, as a synchronous save does).

One write is in flight at a time: the staged buffers are reused, so ``start`` refuses to run while the
previous write has not been collected with ``result()``.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from megatron.core.dist_checkpointing import files
from megatron.core.dist_checkpointing.errors import CheckpointWriteError
from megatron.core.dist_checkpointing.files import group_rank
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.sharded_io import prepare_write
from megatron.core.dist_checkpointing.torch_dist import _BlockSavePlanner, _reraise, _writer, save_state

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every staged block starts at a multiple (any dtype's alignment)


class HostStager(AsyncStager):
    """``AsyncStager`` for ``torch_dist.save_state``'s layout: the blocks copied into host buffers of
    exactly their shapes, carved from one anonymous memory map (page-locked with ``cudaHostRegister``
    when a block is on a GPU) that is allocated at the first ``stage`` and reused while the blocks'
    shapes and dtypes stay the same. Each staged block's storage is exactly its bytes, so DCP writes it
    without another copy. The objects (already pickled) are passed through."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._layout: list[tuple[tuple[int, ...], torch.dtype]] | None = None
        self._buffers: list[torch.Tensor] = []
        self._registered: int | None = None  # address of the page-locked map
        self.nbytes = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The staged copy of ``state_dict`` (complete when this returns)."""
        tensors: list[torch.Tensor] = state_dict["tensors"]
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        if layout != self._layout:
            self._allocate(layout, pin=any(t.is_cuda for t in tensors))
        on_gpu = False
        with torch.no_grad():
            for dst, src in zip(self._buffers, tensors):
                dst.copy_(src, non_blocking=src.is_cuda and self._registered is not None)
                on_gpu = on_gpu or src.is_cuda
        if on_gpu:
            torch.cuda.synchronize()
        return {"tensors": list(self._buffers), "objects": state_dict["objects"]}

    def _allocate(self, layout: list[tuple[tuple[int, ...], torch.dtype]], pin: bool) -> None:
        self.close()
        sizes = [
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout
        ]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        mapped = -(-max(total, 1) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: what gets page-locked
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        region = mmap.mmap(-1, mapped, flags=private) if private else mmap.mmap(-1, mapped)
        self._buffers = [
            torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset).view(dtype).view(shape)
            if size
            else torch.empty(shape, dtype=dtype)
            for (shape, dtype), size, offset in zip(layout, sizes, offsets)
        ]
        if pin and torch.cuda.is_available():
            base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
            error = int(torch.cuda.cudart().cudaHostRegister(base, mapped, 1))  # 1: portable
            if error == 0:
                self._registered = base
            else:  # pageable buffers still work: the copies are then synchronous
                logger.warning(
                    "could not page-lock %d bytes of checkpoint staging buffers (cudaHostRegister error %d); "
                    "staging into pageable memory (slower copies)",
                    mapped,
                    error,
                )
        self._layout, self.nbytes = layout, total

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a complete copy."""

    def close(self) -> None:
        """Release the buffers (unpinning them)."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._buffers, self._layout, self.nbytes = [], None, 0


class PendingWrite:
    """One checkpoint being written in the background (``AsyncWriter.start``)."""

    def __init__(self, checkpoint_dir: str, future: Future, started: float, process_group: Any) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.started = started  # time.monotonic() when ``start`` was called
        self.staged_s = time.monotonic() - started  # what ``start`` blocked its caller for
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
        self._stager = HostStager()
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
        self._pending = PendingWrite(checkpoint_dir, future, t0, self._write_group)
        return self._pending

    def close(self) -> None:
        """Wait for a write in flight (its errors are the caller's to collect), free the staged buffers."""
        if self._pending is not None and not self._pending.collected:
            self._pending.wait()
        self._stager.close()
        if self._write_group is not None:
            dist.destroy_process_group(self._write_group)
            self._write_group = None


__all__ = ["AsyncWriter", "HostStager", "PendingWrite"]
