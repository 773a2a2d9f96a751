"""Checkpoint glue for the training loop: Megatron's directory layout on top of dist_checkpointing.

    <save>/latest_checkpointed_iteration.txt   the integer iteration of the newest complete checkpoint
    <save>/iter_0000100/                       one torch_dist checkpoint (DCP files + metadata.json)

A save writes every file into ``iter_XXXXXXX.saving`` (``metadata.json`` last), renames it to
``iter_XXXXXXX`` (an existing checkpoint of that iteration is renamed aside first and removed after:
``checkpoint_dirs``), then writes the tracker file, atomically. A save killed at any point therefore
leaves the tracker naming a complete checkpoint; a save that fails (disk full) removes what it wrote
and ends the run with one line. Each checkpoint records whether its model and optimizer tensors were
all finite (``finite``). What is stored: ``model`` and ``optimizer`` (sharded), ``opt_param_scheduler``
(plain), ``rng_state`` (one ShardedObject per (tp, pp) rank: ``checkpoint_rng``), ``fp8_state`` (delayed
FP8 scaling's amax histories, when FP8 is on) and the caller's ``extra_state`` (iteration, consumed
samples, FLOPs so far, ``args``, ``checkpoint_version``) as common values.

Loading also reads Megatron-LM's legacy ``torch`` format (``mp_rank_*`` folders), told apart by its
files: see ``legacy_checkpoint``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
)
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata
from megatron.training import checkpoint_advice, checkpoint_dirs, legacy_checkpoint
from megatron.training.checkpoint_advice import FINITE_KEY
from megatron.training.checkpoint_common import (
    RESET_ON_FINETUNE,
    barrier,
    check_model_args,
    find_arg,
    is_distributed,
    quiet,
    rank,
)
from megatron.training.checkpoint_dirs import TRACKER_FILENAME, read_tracker, write_tracker
from megatron.training.checkpoint_rng import get_rng_state, load_rng_state, rng_object, set_rng_state

__all__ = [
    "TRACKER_FILENAME",
    "NonFiniteStateError",
    "check_model_args",
    "find_arg",
    "get_checkpoint_name",
    "get_rng_state",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
    "write_tracker",
]

CKPT_FORMAT = "torch_dist"
CONTENTS_KEY = "checkpoint_contents"
_RESERVED_KEYS = (
    "model",
    "optimizer",
    "opt_param_scheduler",
    "rng_state",
    "fp8_state",
    CONTENTS_KEY,
    FINITE_KEY,
)


def get_checkpoint_name(root: str, iteration: int) -> str:
    """``<root>/iter_{iteration:07d}``."""
    return checkpoint_dirs.iteration_dir(root, iteration)


class NonFiniteStateError(RuntimeError):
    """``save_checkpoint(require_finite=True)`` found a NaN or Inf in the model or optimizer tensors."""


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
) -> None:
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

    Raises:
        ValueError: ``extra_state`` uses a reserved key, or the sharded state dict is inconsistent.
        CheckpointWriteError: a file could not be written (on any rank): what was written of this
            checkpoint is removed and the tracker still names the previous one.
        NonFiniteStateError: ``require_finite`` and a tensor is not finite; nothing was written.
    """
    clash = sorted(set(extra_state) & set(_RESERVED_KEYS))
    if clash:
        raise ValueError(f"extra_state keys {clash} are reserved for the checkpoint layout")
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
        dist_checkpointing.save(state, staging, common_state=common)  # ends with metadata.json
    except CheckpointWriteError as e:
        # Every rank is past its writes: DCP reports a rank's failure to all, metadata.json is rank 0's.
        if is_rank0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(save_dir, _failed_save_reason(e, save_dir, iteration, staging)) from None
    if is_rank0:
        _publish(save_dir, ckpt_dir, iteration)
        log(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir}")
    barrier()


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


def _agreed_iteration(iteration: int | None) -> int | None:
    """The largest iteration any rank sees (ranks may lag on a slow shared file system)."""
    if not is_distributed():
        return iteration
    seen: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, iteration)
    known = [i for i in seen if i is not None]
    return max(known) if known else None


def _resolve_checkpoint(
    load_dir: str, ckpt_step: int | None, exit_on_missing_checkpoint: bool, log: Callable[[str], None]
) -> tuple[int, str] | None:
    iteration = ckpt_step if ckpt_step is not None else _agreed_iteration(read_tracker(load_dir))
    if iteration is None:
        if exit_on_missing_checkpoint:
            raise CheckpointError(
                f"--load {load_dir}: no checkpoint found (no {TRACKER_FILENAME}) and "
                "--exit-on-missing-checkpoint is set; check the path, or drop the flag to start from scratch"
            )
        if rank() == 0:
            log(f"no checkpoint found in {load_dir} (no {TRACKER_FILENAME}): starting from scratch")
        return None
    name = get_checkpoint_name(load_dir, iteration)
    if rank() == 0:
        checkpoint_dirs.repair(name, log)  # a save killed while replacing this checkpoint
    barrier()
    ckpt_dir = checkpoint_dirs.resolve(name)
    source = f"--ckpt-step {ckpt_step}" if ckpt_step is not None else f"{TRACKER_FILENAME} in {load_dir}"
    try:
        dist_checkpointing.read_metadata_json(ckpt_dir)
    except CheckpointError as e:
        raise CheckpointError(
            f"{e}. {source} names iteration {iteration}; write the iteration of a complete iter_XXXXXXX "
            f"directory (one with {dist_checkpointing.METADATA_FILE}) into {TRACKER_FILENAME}, or pass "
            "--ckpt-step N"
        ) from None
    return iteration, ckpt_dir


def _load_dir_and_step(
    load_dir: str, ckpt_step: int | None, log: Callable[[str], None]
) -> tuple[str, int | None]:
    """``--load .../iter_0000100`` (a checkpoint, not the directory of a run's checkpoints) means that
    checkpoint: Megatron users pass it, and its name and files say which one is meant."""
    parent, iteration = checkpoint_dirs.split_iteration_dir(load_dir)
    if iteration is None:
        return load_dir, ckpt_step
    if ckpt_step is not None and ckpt_step != iteration:
        raise ConfigError(
            f"--load {load_dir} is the checkpoint of iteration {iteration} but --ckpt-step {ckpt_step} "
            f"asks for another: pass --load {parent} --ckpt-step {ckpt_step}, or drop --ckpt-step"
        )
    if rank() == 0:
        log(
            f"--load {load_dir} is the checkpoint of iteration {iteration}: loading it as --load {parent} "
            f"--ckpt-step {iteration}"
        )
    return parent, iteration


def load_checkpoint(
    load_dir: str,
    model_sharded_state_dict: dict,
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    ckpt_step: int | None = None,
    exit_on_missing_checkpoint: bool = False,
    model_args_check: dict[str, Any] | None = None,
    parallel_state: Any = None,
    rng_restore_fn: Callable[[Any], None] | None = None,
    fp8_state: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict | None:
    """Collectively load the newest (or ``ckpt_step``) checkpoint of ``load_dir`` in place.

    ``load_dir`` may also be one checkpoint, ``<dir>/iter_0000100``: that one is loaded. A directory
    in Megatron-LM's legacy ``torch`` format is read by ``legacy_checkpoint`` (weights, iteration,
    consumed samples and schedule; the optimizer restarts from the weights).

    Model tensors of ``model_sharded_state_dict`` are filled in place (any saving layout works). The
    optimizer (``load_sharded_state_dict``) and scheduler (``load_state_dict``) are restored unless
    ``load_optim`` is False or ``finetune``; RNG states unless ``load_rng`` is False, ``finetune``, or
    the checkpoint was saved under another (tp, pp) layout (then a line says so). ``fp8_state`` (the
    FP8 amax histories, filled in place) where the checkpoint holds them with the same history
    length, unless ``finetune``; otherwise a line says they restart.

    Returns:
        The saved ``extra_state`` (with iteration, consumed samples and FLOPs reset to 0 when
        ``finetune``), or None when there is no checkpoint to resume from.

    Raises:
        ConfigError: ``load_dir`` is one checkpoint and ``ckpt_step`` names another.
        CheckpointError: no checkpoint with ``exit_on_missing_checkpoint``; the tracker or
            ``ckpt_step`` names a missing or incomplete checkpoint; ``model_args_check`` differs from
            the saved args; the optimizer state was asked for but not saved, or saved for another
            precision; missing keys or shape mismatch.
        CheckpointReadError: a file of the checkpoint is missing, truncated or unreadable (named, with
            the ``--ckpt-step`` of another checkpoint to load).
    """
    load_dir, ckpt_step = _load_dir_and_step(load_dir, ckpt_step, log)
    legacy = legacy_checkpoint.find_legacy_checkpoint(load_dir, ckpt_step)
    if legacy is not None:  # the format is told by the files, as Megatron's --auto-detect-ckpt-format
        return legacy_checkpoint.load_legacy_checkpoint(
            legacy,
            model_sharded_state_dict,
            optimizer,
            opt_param_scheduler,
            load_optim=load_optim,
            load_rng=load_rng,
            finetune=finetune,
            model_args_check=model_args_check,
            fp8_state=fp8_state,
            log=log,
        )
    found = _resolve_checkpoint(load_dir, ckpt_step, exit_on_missing_checkpoint, log)
    if found is None:
        return None
    iteration, ckpt_dir = found
    is_rank0 = rank() == 0
    if is_rank0:
        log(f"loading checkpoint from {load_dir} at iteration {iteration}")
    restore_optim = optimizer is not None and load_optim and not finetune
    say = log if is_rank0 else quiet
    try:
        common = _load_state(
            ckpt_dir,
            model_sharded_state_dict,
            optimizer if restore_optim else None,
            opt_param_scheduler,
            model_args_check,
            say,
        )
        if load_rng and not finetune:
            load_rng_state(ckpt_dir, parallel_state, rng_restore_fn, say)
        if fp8_state and not finetune:
            _load_fp8_state(ckpt_dir, fp8_state, say)
    except CheckpointReadError as e:
        raise CheckpointReadError(
            f"{e}; {checkpoint_advice.another_checkpoint(load_dir, iteration)}"
        ) from None

    extra = {k: v for k, v in common.items() if k not in _RESERVED_KEYS}
    if finetune:
        extra.update({k: 0 for k in RESET_ON_FINETUNE})
    if is_rank0:
        log(f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}")
    return extra


def _load_state(
    ckpt_dir: str,
    model_sharded_state_dict: dict,
    optimizer: Any,
    opt_param_scheduler: Any,
    model_args_check: dict[str, Any] | None,
    log: Callable[[str], None],
) -> dict:
    """Check the saved args, fill the model (and, given one, the optimizer and scheduler) in place;
    return the checkpoint's common values."""
    common = dist_checkpointing.load_common_state(ckpt_dir)
    if model_args_check:
        check_model_args(common.get("args", {}), model_args_check, ckpt_dir, log)
    if common.get(FINITE_KEY) is False:
        log(
            f"warning: {ckpt_dir} holds NaN or Inf in its model or optimizer tensors (saved with "
            "--no-check-for-nan-in-loss-and-grad); training from it gives NaN"
        )
    request: dict[str, Any] = {"model": model_sharded_state_dict}
    if optimizer is not None:
        if "optimizer" not in common.get(CONTENTS_KEY, list(_RESERVED_KEYS)):
            raise CheckpointError(
                f"{ckpt_dir} holds no optimizer state (saved with --no-save-optim); "
                "resume with --no-load-optim or --finetune"
            )
        request["optimizer"] = optimizer.sharded_state_dict(model_sharded_state_dict)
        checkpoint_advice.check_optimizer_precision(
            ckpt_dir,
            dist_checkpointing.sharded_tensors(model_sharded_state_dict),
            dist_checkpointing.sharded_tensors(request["optimizer"]),
        )
    loaded = dist_checkpointing.load(request, ckpt_dir)
    if optimizer is not None:
        optimizer.load_sharded_state_dict(loaded["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in common:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    return common


def _load_fp8_state(ckpt_dir: str, fp8_state: dict, log: Callable[[str], None]) -> None:
    """Fill the FP8 amax histories in place from the checkpoint, where it holds every one of them with
    the same shape (same model, same --fp8-amax-history-len); otherwise say that they restart."""
    saved = read_dcp_metadata(ckpt_dir).state_dict_metadata
    ok = all(
        tuple(getattr(saved.get(t.key), "size", ())) == tuple(t.global_shape) for t in fp8_state.values()
    )
    if not ok:
        log(
            "  FP8 amax histories: not in the checkpoint (saved without FP8, with another --fp8-amax-history-len "
            "or with other layers in FP8, --first-last-layers-bf16); they restart with the first step"
        )
        return
    dist_checkpointing.load({"fp8_state": fp8_state}, ckpt_dir)
