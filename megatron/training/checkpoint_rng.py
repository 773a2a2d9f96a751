"""RNG state in a checkpoint: capture and restore of every generator, and the ShardedObject that
keeps one copy per (tp, pp) rank (``checkpointing`` saves and loads it under ``rng_state``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.training.checkpoint_common import rank


def rng_object(parallel_state: Any, data: Any) -> ShardedObject:
    """RNG state of this rank: one object per (tp, pp) rank; dp/cp/ep copies are replicas.

    Without a ``parallel_state`` every rank counts as a data-parallel rank (tp = pp = 1).
    """
    if parallel_state is None:
        return ShardedObject("rng_state", data, replica_id=(rank(), 0, 0), shard_key="tp_0_of_1.pp_0_of_1")
    tp, tp_size = getattr(parallel_state, "tp_rank", 0), getattr(parallel_state, "tp_size", 1)
    pp, pp_size = getattr(parallel_state, "pp_rank", 0), getattr(parallel_state, "pp_size", 1)
    replica = tuple(int(getattr(parallel_state, f"{axis}_rank", 0)) for axis in ("dp", "cp", "ep"))
    return ShardedObject(
        "rng_state", data, replica_id=replica, shard_key=f"tp_{tp}_of_{tp_size}.pp_{pp}_of_{pp_size}"
    )


def get_rng_state(rng_state_fn: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states, plus ``rng_state_fn()`` under ``extra``."""
    state: dict[str, Any] = {"random": random.getstate(), "torch": torch.get_rng_state()}
    state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if rng_state_fn is not None:
        state["extra"] = rng_state_fn()
    return state


def set_rng_state(state: dict[str, Any], rng_restore_fn: Callable[[Any], None] | None = None) -> None:
    """Restore what ``get_rng_state`` captured (``extra`` goes to ``rng_restore_fn`` if given)."""
    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "extra" in state and rng_restore_fn is not None:
        rng_restore_fn(state["extra"])


def load_rng_state(
    ckpt_dir: str,
    parallel_state: Any,
    rng_restore_fn: Callable[[Any], None] | None,
    log: Callable[[str], None],
) -> None:
    """Restore this rank's RNG state from ``ckpt_dir``; say so where it holds none for this rank."""
    wanted = rng_object(parallel_state, None)
    got = dist_checkpointing.load({"rng_state": wanted}, ckpt_dir, strict=False)
    if "rng_state" not in got:
        log(
            f"not loading RNG state: {ckpt_dir} has none for {wanted.unique_key} "
            "(saved with --no-save-rng or under another (tp, pp) layout)"
        )
        return
    set_rng_state(got["rng_state"], rng_restore_fn)
