"""What a run says when a checkpoint cannot be used as it is: which other one to load, which flag differs.

Used by the checkpoint glue (a damaged file; optimizer state saved for another precision) and by the
training loop when it stops on NaN (the newest checkpoint older than the weights that diverged whose
tensors were finite when saved).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointError, ShardedTensor
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata
from megatron.training.checkpoint_common import FINITE_KEY
from megatron.training.checkpoint_dirs import complete_iterations, iteration_dir, resolve, split_iteration_dir


def _intact(ckpt_dir: str) -> dict | None:
    """The common values of a complete checkpoint whose files are all there and long enough, else None."""
    try:
        common = dist_checkpointing.load_common_state(ckpt_dir)
        dist_checkpointing.check_files(ckpt_dir)
    except CheckpointError:
        return None
    return common


def another_checkpoint(root: str, damaged: int) -> str:
    """Advice after the checkpoint of iteration ``damaged`` turned out damaged: the newest intact
    older one (else the newest intact newer one) of ``root``."""
    others = [it for it in complete_iterations(root) if it != damaged]
    for it in [i for i in others if i < damaged] + [i for i in others if i > damaged]:
        if _intact(resolve(iteration_dir(root, it))) is not None:
            which = "older " if it < damaged else ""
            return f"load another checkpoint with --ckpt-step {it} (the newest {which}intact one in {root}), or restore the file"
    return f"{root} holds no other intact checkpoint: restore the file, or start from scratch without --load"


def newest_finite_checkpoint(roots: list[str], before: int) -> tuple[str, int] | None:
    """(root, iteration) of the newest intact checkpoint under ``roots`` older than iteration ``before``
    whose tensors were recorded finite (checkpoints older than the record count as finite)."""
    best: tuple[str, int] | None = None
    for root in roots:
        for it in complete_iterations(root):
            if it >= before or (best is not None and it <= best[1]):
                continue
            common = _intact(resolve(iteration_dir(root, it)))
            if common is not None and common.get(FINITE_KEY, True) is not False:
                best = (root, it)
                break
    return best


def checkpoint_roots(dirs: Iterable[str | None]) -> list[str]:
    """The run directories among ``--save`` / ``--load`` (an ``iter_*`` ``--load`` stands for its parent)."""
    return list(dict.fromkeys(split_iteration_dir(d)[0] for d in dirs if d))


def saved_at(roots: list[str], iteration: int) -> str | None:
    """A complete checkpoint of ``iteration`` under ``roots``, or None."""
    for root in roots:
        if iteration in complete_iterations(root):
            return resolve(iteration_dir(root, iteration))
    return None


def resume_advice(roots: list[str], before: int) -> str:
    """Where to resume when the state of iteration ``before`` cannot be trained on (it gave, or holds, NaN)."""
    if not roots:
        return "nothing was saved (no --save)"
    if before <= 0:
        return "it was the first step: no checkpoint can help"
    found = newest_finite_checkpoint(roots, before)
    if found is None:
        return (
            f"no checkpoint before iteration {before} with finite weights is in {' or '.join(roots)}: start "
            "again from scratch (without --load)"
        )
    root, it = found
    return (
        f"the newest checkpoint before it with finite weights, iteration {it} in {root}, is intact: resume from "
        f"it with --load {root} --ckpt-step {it}"
    )


_PRECISION = {torch.bfloat16: ("bf16", "--bf16"), torch.float16: ("fp16", "--fp16")}


def _precision(dtype: torch.dtype) -> str:
    name = "fp32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
    name, flag = _PRECISION.get(dtype, (name, "neither --bf16 nor --fp16"))
    return f"{name} ({flag})"


def _resume_with(saved: torch.dtype, current: torch.dtype) -> str:
    """How to train in the checkpoint's precision again: ``with --bf16``, ``without --fp16``, ..."""
    if saved in _PRECISION:
        flag = _PRECISION[saved][1]
        return (
            f"with {flag}"
            if current not in _PRECISION
            else f"with {flag} instead of {_PRECISION[current][1]}"
        )
    return f"without {_PRECISION[current][1]}" if current in _PRECISION else "in the checkpoint's precision"


def _common_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    counts = Counter(dtypes).most_common(1)
    return counts[0][0] if counts else None


def check_optimizer_precision(
    ckpt_dir: str, model: list[ShardedTensor], optimizer: list[ShardedTensor]
) -> None:
    """Refuse, naming the flag, an optimizer state the checkpoint lacks because it was trained in
    another precision (an fp32 run keeps no fp32 main-parameter copies; a --bf16 run does).

    Raises:
        CheckpointError: optimizer tensors are missing and the model weights were saved in another dtype.
    """
    saved_md = read_dcp_metadata(ckpt_dir).state_dict_metadata
    missing = [t.key for t in optimizer if t.key not in saved_md]
    if not missing:
        return
    entries = [saved_md.get(t.key) for t in model]
    saved = _common_dtype(e.properties.dtype for e in entries if isinstance(e, TensorStorageMetadata))
    current = _common_dtype(t.data.dtype for t in model)
    if saved is None or current is None or saved == current:
        return
    raise CheckpointError(
        f"{ckpt_dir} was trained in {_precision(saved)} and this run trains in {_precision(current)}: its optimizer "
        f"state lacks the {len(missing)} tensors this precision keeps (e.g. {missing[0]}); resume "
        f"{_resume_with(saved, current)} to load it, or pass --no-load-optim to start the optimizer from the "
        "loaded weights"
    )
