"""What the two checkpoint readers share (``checkpointing`` for ``torch_dist``, ``legacy_checkpoint``
for Megatron-LM's ``torch`` format): the check of the saved model args against the current run,
the values a ``--finetune`` load resets, and the rank helpers of a job that may be one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.dist_checkpointing.consistency import CONTENTS_KEY

CKPT_FORMAT = "torch_dist"
FINITE_KEY = "finite"
# Top-level names of a checkpoint that are not the caller's extra_state.
RESERVED_KEYS = (
    "model",
    "optimizer",
    "opt_param_scheduler",
    "rng_state",
    "fp8_state",
    CONTENTS_KEY,
    FINITE_KEY,
)

# Values of the saved ``extra_state`` that a --finetune load (or a release checkpoint) sets to 0.
RESET_ON_FINETUNE = (
    "iteration",
    "consumed_train_samples",
    "consumed_valid_samples",
    "num_floating_point_operations_so_far",
)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def quiet(_: str) -> None:
    """A log function that prints nothing (ranks other than 0)."""


def find_arg(tree: Any, name: str) -> tuple[bool, Any]:
    """Breadth-first search for key ``name`` in a nested dict of saved args."""
    level = [tree]
    while level:
        nxt: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                if name in node:
                    return True, node[name]
                nxt.extend(node.values())
        level = nxt
    return False, None


def check_model_args(
    saved_args: Any, model_args_check: dict[str, Any], ckpt_dir: str, log: Callable[[str], None] = print
) -> None:
    """Compare ``{flag: current value}`` with the checkpoint's ``args``; flags are ``--num-layers`` style.

    Raises:
        CheckpointError: listing each flag whose checkpoint value differs from the current one.
    """
    mismatches, unrecorded = [], []
    for flag, current in model_args_check.items():
        found, saved = find_arg(saved_args, flag.lstrip("-").replace("-", "_"))
        if not found:
            unrecorded.append(flag)
        elif (list(saved) if isinstance(saved, tuple) else saved) != (
            list(current) if isinstance(current, tuple) else current
        ):
            mismatches.append(f"  {flag}: checkpoint {saved!r} vs current {current!r}")
    if unrecorded:
        log(f"note: {ckpt_dir} does not record {', '.join(unrecorded)}; not checked")
    if mismatches:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved for a different model:\n"
            + "\n".join(mismatches)
            + "\nset these flags to the checkpoint's values, or --load a checkpoint of this model"
        )
