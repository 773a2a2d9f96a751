"""Saving one checkpoint: Megatron's ``iter_XXXXXXX`` directory on top of dist_checkpointing.

A save writes every file into ``iter_XXXXXXX.saving`` (``metadata.json`` last), renames it to
``iter_XXXXXXX`` (an existing checkpoint of that iteration is renamed aside first and removed after:
``checkpoint_dirs``), then writes the tracker file, atomically. A save killed at any point therefore
leaves the tracker naming a complete checkpoint; a save that fails (disk full) removes what it wrote
and ends the run with one line. Loading is ``checkpointing``'s.

With an ``AsyncWriter`` (``--async-save``) the save returns once the state is staged in host memory; the
files are written in the background and ``finish_async_save`` (between steps, once the write is done)
writes ``metadata.json``, renames and points the tracker at it: the same protocol, so a kill at any point
of an asynchronous save also leaves the tracker naming the previous complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointError, CheckpointWriteError
from megatron.core.dist_checkpointing.async_save import AsyncWriter, PendingWrite
from megatron.training import checkpoint_dirs
from megatron.training.checkpoint_common import (
    CKPT_FORMAT,
    CONTENTS_KEY,
    FINITE_KEY,
    RESERVED_KEYS,
    barrier,
    rank,
)
from megatron.training.checkpoint_dirs import TRACKER_FILENAME, read_tracker, write_tracker
from megatron.training.checkpoint_rng import get_rng_state, rng_object


def get_checkpoint_name(root: str, iteration: int) -> str:
    """``<root>/iter_{iteration:07d}``."""
    return checkpoint_dirs.iteration_dir(root, iteration)


class NonFiniteStateError(RuntimeError):
    """``save_checkpoint(require_finite=True)`` found a NaN or Inf in the model or optimizer tensors."""


@dataclass
class AsyncSave:
    """A save started by ``save_checkpoint(writer=...)``: its files are being written in the background."""

    save_dir: str
    iteration: int
    write: PendingWrite

    def done(self) -> bool:
        """This rank's files are written (or failed): ``finish_async_save`` will not block."""
        return self.write.done()


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_sharded_state_dict: dict,
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    extra_state: dict,
    save_optim: bool = True,
    save_rng: bool = True,
    parallel_state: Any = None,
    rng_state_fn: Callable[[], Any] | None = None,
    fp8_state: dict | None = None,
    require_finite: bool = False,
    log: Callable[[str], None] = print,
    writer: AsyncWriter | None = None,
) -> AsyncSave | None:
    """Collectively save ``iter_{iteration:07d}`` under ``save_dir``, then point the tracker at it.

    The files are written beside any existing checkpoint of that iteration and swapped in once
    complete (``checkpoint_dirs``): a complete checkpoint of the iteration exists at every instant.

    Args:
        optimizer: duck-typed; ``optimizer.sharded_state_dict(model_sharded_state_dict)`` is saved
            under ``optimizer`` unless ``save_optim`` is False.
        opt_param_scheduler: duck-typed; ``state_dict()`` is saved as a plain dict.
        extra_state: plain values stored at the top level (iteration, consumed samples, ``args``, ...).
        parallel_state: anything with ``tp_rank/tp_size/pp_rank/pp_size/dp_rank`` (``cp_rank``,
            ``ep_rank`` optional); keys the RNG state so that each (tp, pp) rank keeps its own. None:
            one process, or pure data parallelism (rank 0's state is saved).
        rng_state_fn: extra RNG state to store (e.g. the CUDA RNG tracker's states).
        fp8_state: sharded tensors of FP8 scaling state (``fusions.fp8.fp8_sharded_state_dict``).
        require_finite: refuse to save model or optimizer tensors holding NaN or Inf (otherwise they
            are saved, recorded as not finite).
        writer: save asynchronously: return, once this rank's state is staged, the ``AsyncSave`` that
            ``finish_async_save`` completes (the tracker still names the previous checkpoint until then).
            None: return once the checkpoint is complete and tracked.

    Raises:
        ValueError: ``extra_state`` uses a reserved key, or the sharded state dict is inconsistent.
        CheckpointWriteError: a file could not be written (on any rank): what was written of this
            checkpoint is removed and the tracker still names the previous one.
        NonFiniteStateError: ``require_finite`` and a tensor is not finite; nothing was written.
    """
    clash = sorted(set(extra_state) & set(RESERVED_KEYS))
    if clash:
        raise ValueError(f"extra_state keys {clash} are reserved for the checkpoint layout")
    started = time.monotonic()
    ckpt_dir = get_checkpoint_name(save_dir, iteration)
    state, common = _state_to_save(
        model_sharded_state_dict,
        optimizer,
        opt_param_scheduler,
        extra_state,
        save_optim,
        save_rng,
        parallel_state,
        rng_state_fn,
        fp8_state,
    )
    common[FINITE_KEY] = dist_checkpointing.all_finite(
        {"model": state["model"], "optimizer": state.get("optimizer")}
    )
    if require_finite and not common[FINITE_KEY]:
        raise NonFiniteStateError(
            f"the model or optimizer state at iteration {iteration} holds NaN or Inf, so "
            f"{ckpt_dir} was not written"
        )
    is_rank0 = rank() == 0
    if is_rank0:
        log(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in {CKPT_FORMAT} format")
        _prepare_save(save_dir, ckpt_dir, iteration, log)
    barrier()
    staging = checkpoint_dirs.staging_dir(ckpt_dir)
    try:
        if writer is not None:
            return AsyncSave(save_dir, iteration, writer.start(state, staging, common_state=common))
        dist_checkpointing.save(state, staging, common_state=common)  # ends with metadata.json
    except CheckpointWriteError as e:
        # Every rank is past its writes: DCP reports a rank's failure to all, metadata.json is rank 0's.
        raise _discarded(e, save_dir, iteration, staging) from None
    if is_rank0:
        _publish(save_dir, ckpt_dir, iteration)
        log(
            f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} in "
            f"{time.monotonic() - started:.2f} s"
        )
    barrier()
    return None


def finish_async_save(save: AsyncSave, log: Callable[[str], None] = print) -> float:
    """Wait for ``save``'s files (at once if ``save.done()``), then on rank 0 write ``metadata.json``,
    rename the checkpoint into place and point the tracker at it. Not collective: rank 0's write ends
    only once every rank's has. Returns the seconds from the start of the write to its completion.

    Raises:
        CheckpointWriteError: a file could not be written on some rank (on every rank): what was written
            of this checkpoint is removed (rank 0) and the tracker still names the previous one.
    """
    ckpt_dir = get_checkpoint_name(save.save_dir, save.iteration)
    staging = checkpoint_dirs.staging_dir(ckpt_dir)
    try:
        seconds = save.write.result()  # rank 0: metadata.json written
    except CheckpointWriteError as e:
        raise _discarded(e, save.save_dir, save.iteration, staging) from None
    if rank() == 0:
        _publish(save.save_dir, ckpt_dir, save.iteration)
        log(
            f"  successfully saved checkpoint from iteration {save.iteration:7d} to {save.save_dir} in "
            f"{seconds:.2f} s (asynchronous: written in the background)"
        )
    return seconds


def _state_to_save(
    model_sharded_state_dict: dict,
    optimizer: Any,
    opt_param_scheduler: Any,
    extra_state: dict,
    save_optim: bool,
    save_rng: bool,
    parallel_state: Any,
    rng_state_fn: Callable[[], Any] | None,
    fp8_state: dict | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the sharded state, the common values) of one checkpoint."""
    state: dict[str, Any] = {"model": model_sharded_state_dict}
    common: dict[str, Any] = dict(extra_state)
    if optimizer is not None and save_optim:
        state["optimizer"] = optimizer.sharded_state_dict(model_sharded_state_dict)
    if opt_param_scheduler is not None:
        common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if save_rng:
        state["rng_state"] = rng_object(parallel_state, get_rng_state(rng_state_fn))
    if fp8_state:
        state["fp8_state"] = fp8_state
    common[CONTENTS_KEY] = sorted(
        [*state, *(["opt_param_scheduler"] if opt_param_scheduler is not None else [])]
    )
    return state, common


def _prepare_save(save_dir: str, ckpt_dir: str, iteration: int, log: Callable[[str], None]) -> None:
    """Rank 0 before the write: the save directory exists, no leftover of an earlier save of the same
    iteration is in the way."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        checkpoint_dirs.remove_staging(ckpt_dir)
    except OSError as e:
        raise CheckpointWriteError(save_dir, str(e)) from None
    if os.path.isdir(ckpt_dir) and read_tracker(save_dir) == iteration:
        log(
            f"warning: replacing {ckpt_dir}, the checkpoint named by {TRACKER_FILENAME}; it stays until the new "
            "one is complete"
        )


def _discarded(
    error: CheckpointWriteError, save_dir: str, iteration: int, staging: str
) -> CheckpointWriteError:
    """A failed write of ``iteration``: rank 0 removes its partial ``staging`` directory; the error to raise
    names what failed and which checkpoint the tracker still names."""
    if rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    return CheckpointWriteError(save_dir, _failed_save_reason(error, save_dir, iteration, staging))


def _failed_save_reason(error: CheckpointWriteError, save_dir: str, iteration: int, staging: str) -> str:
    try:
        newest = read_tracker(save_dir)
    except CheckpointError:
        newest = None
    kept = (
        f"{TRACKER_FILENAME} still names iteration {newest}"
        if newest is not None
        else "no earlier checkpoint is named by a tracker"
    )
    return (
        f"saving iteration {iteration} failed: {error.reason}; removed the partial {staging}; {kept}. Fix that "
        "(free space or quota, permissions), or pass --save a directory on another file system, and resume"
    )


def _publish(save_dir: str, ckpt_dir: str, iteration: int) -> None:
    """Rank 0 after the write: swap the complete checkpoint in, then point the tracker at it."""
    try:
        checkpoint_dirs.swap_in(ckpt_dir)
        write_tracker(save_dir, iteration)
    except OSError as e:
        raise CheckpointWriteError(
            save_dir,
            f"saving iteration {iteration}: {e} (after every file was written, "
            "while renaming it into place or updating the tracker)",
        ) from None
