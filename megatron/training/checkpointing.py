"""Checkpoint glue for the training loop: Megatron's directory layout on top of dist_checkpointing.

    <save>/latest_checkpointed_iteration.txt   the integer iteration of the newest complete checkpoint
    <save>/iter_0000100/                       one torch_dist checkpoint (DCP files + metadata.json)

Saving is ``checkpoint_save``'s (re-exported here): files first, the tracker last, atomically. Each
checkpoint records whether its model and optimizer tensors were all finite (``finite``). What is
stored: ``model`` and ``optimizer`` (sharded), ``opt_param_scheduler`` (plain), ``rng_state`` (one
ShardedObject per (tp, pp) rank: ``checkpoint_rng``), ``fp8_state`` (delayed FP8 scaling's amax
histories, when FP8 is on) and the caller's ``extra_state`` (iteration, consumed samples, FLOPs so far,
``args``, ``checkpoint_version``) as common values.

Loading also reads Megatron-LM's legacy ``torch`` format (``mp_rank_*`` folders), told apart by its
files: see ``legacy_checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import (
    CheckpointError,
    CheckpointReadError,
)
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata
from megatron.training import checkpoint_advice, checkpoint_dirs, legacy_checkpoint
from megatron.training.checkpoint_common import (
    CONTENTS_KEY,
    FINITE_KEY,
    RESERVED_KEYS,
    RESET_ON_FINETUNE,
    barrier,
    check_model_args,
    find_arg,
    is_distributed,
    quiet,
    rank,
)
from megatron.training.checkpoint_dirs import TRACKER_FILENAME, read_tracker, write_tracker
from megatron.training.checkpoint_rng import get_rng_state, load_rng_state, set_rng_state
from megatron.training.checkpoint_save import NonFiniteStateError, get_checkpoint_name, save_checkpoint

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
    check_common: Callable[[dict, str], None] | None = None,
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

    A checkpoint converted from another format (its common values name ``converted_from``: it holds
    weights only) is loaded as ``finetune`` loads any checkpoint, with a line saying so: its weights,
    and the run starts at iteration 0 (as Megatron treats a ``release`` checkpoint).

    ``check_common(common, ckpt_dir)`` is called on every rank with the checkpoint's common values
    before any tensor is read (torch_dist checkpoints only); it may raise to refuse the load.

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
    say = log if is_rank0 else quiet
    try:
        common = dist_checkpointing.load_common_state(ckpt_dir)
        finetune = finetune or _weights_only(common, ckpt_dir, say)
        restore_optim = optimizer is not None and load_optim and not finetune
        if check_common is not None:
            check_common(common, ckpt_dir)
        _load_state(
            ckpt_dir,
            common,
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

    extra = {k: v for k, v in common.items() if k not in RESERVED_KEYS}
    if finetune:
        extra.update({k: 0 for k in RESET_ON_FINETUNE})
    if is_rank0:
        log(f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}")
    return extra


def _weights_only(common: dict, ckpt_dir: str, log: Callable[[str], None]) -> bool:
    """A converted checkpoint (``converted_from``): weights only, loaded as with --finetune; says so."""
    source = common.get("converted_from")
    if not source:
        return False
    log(
        f"note: {ckpt_dir} was converted from {source} and holds weights only (no optimizer, RNG or "
        "scheduler state): loading its weights and starting at iteration 0"
    )
    return True


def _load_state(
    ckpt_dir: str,
    common: dict,
    model_sharded_state_dict: dict,
    optimizer: Any,
    opt_param_scheduler: Any,
    model_args_check: dict[str, Any] | None,
    log: Callable[[str], None],
) -> None:
    """Check the saved args (``common["args"]``), fill the model (and, given one, the optimizer and
    scheduler) in place."""
    if model_args_check:
        check_model_args(common.get("args", {}), model_args_check, ckpt_dir, log)
    if common.get(FINITE_KEY) is False:
        log(
            f"warning: {ckpt_dir} holds NaN or Inf in its model or optimizer tensors (saved with "
            "--no-check-for-nan-in-loss-and-grad); training from it gives NaN"
        )
    request: dict[str, Any] = {"model": model_sharded_state_dict}
    if optimizer is not None:
        if "optimizer" not in common.get(CONTENTS_KEY, list(RESERVED_KEYS)):
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
