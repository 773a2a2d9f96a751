"""The files of a ``torch_dist`` checkpoint and the collectives that save and load use.

A checkpoint directory holds DCP's files (``.metadata``, ``__{rank}_{n}.distcp``) and our
``metadata.json``, written last: its presence marks a complete checkpoint. The plain (common) values
are one pickled object ``common_state`` inside the DCP checkpoint.

A file that cannot be written (disk full, quota, permissions) is a ``CheckpointWriteError``; a checkpoint
to load whose files are missing, truncated or unreadable is a ``CheckpointReadError``; both are one line
naming the file, raised before any tensor is read when the damage can be seen from ``.metadata`` and
the file sizes (``consistency``: chunks without a file, chunks not covering their tensor, contents the
common state lists but ``.metadata`` lacks; ``torch_dist.file_problems``: files missing or truncated).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.consistency import (
    COMMON_STATE_KEY,
    CONTENTS_KEY,
    contents_problems,
    index_problems,
)
from megatron.core.dist_checkpointing.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.state_tree import iter_sharded
from megatron.core.dist_checkpointing.torch_dist import dcp_load, file_problems, read_dcp_metadata

METADATA_FILE = "metadata.json"
SHARDED_BACKEND = "torch_dist"
SHARDED_BACKEND_VERSION = 1
FORMAT_MAGIC = "megatron-dist-checkpoint"
FORMAT_VERSION = 1


def sharded_tensors(tree: Any) -> list[ShardedTensor]:
    """The ShardedTensor leaves of a nested dict/list (a sharded state dict), in a deterministic order."""
    return [leaf for leaf in iter_sharded(tree) if isinstance(leaf, ShardedTensor)]


_FINITE_CHUNK = 1 << 26  # elements per isfinite pass: bounds the temporary bool tensor at 64 MiB


def _is_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``t``'s device: no NaN or Inf in ``t``."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= _FINITE_CHUNK:
        return torch.isfinite(flat).all()
    return torch.stack([torch.isfinite(c).all() for c in flat.split(_FINITE_CHUNK)]).all()


def all_finite(sharded_state_dict: Any, process_group: Any = None) -> bool:
    """Collective (one all-reduce over ``process_group``): every floating ShardedTensor of every rank
    holds no NaN or Inf."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in sharded_tensors(sharded_state_dict):
        data = t.local_data()
        if data.is_floating_point():
            per_device.setdefault(data.device, []).append(_is_finite(data))
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend(process_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.ones((), dtype=torch.int32, device=device)
    for flags in per_device.values():  # one copy to the reduction's device per device, no sync per tensor
        flag &= torch.stack(flags).all().to(device=device, dtype=torch.int32)
    if group_size(process_group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
    return bool(flag.item())


def group_size(process_group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


def group_rank(process_group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group)
    return 0


def all_gather(obj: Any, process_group: Any) -> list[Any]:
    if group_size(process_group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def barrier(process_group: Any) -> None:
    if group_size(process_group) > 1:
        dist.barrier(group=process_group)


def raise_if_any(errors: list[str], process_group: Any, prefix: str) -> None:
    """Collective: every rank raises the same CheckpointError if any rank found a problem."""
    all_errors = sorted({e for rank_errors in all_gather(errors, process_group) for e in rank_errors})
    if all_errors:
        raise errors_exception(all_errors, prefix)


def errors_exception(errors: list[str], prefix: str) -> CheckpointError:
    """One CheckpointError listing ``errors`` (the first 20) under ``prefix``."""
    shown = errors[:20]
    more = f" (and {len(errors) - len(shown)} more)" if len(errors) > len(shown) else ""
    return CheckpointError(prefix + "\n  " + "\n  ".join(shown) + more)


def write_metadata_json(checkpoint_dir: str) -> None:
    """Atomically write ``metadata.json`` (the completion marker); callers run it on one rank.

    Raises:
        CheckpointWriteError: the file cannot be written.
    """
    content = {
        "sharded_backend": SHARDED_BACKEND,
        "sharded_backend_version": SHARDED_BACKEND_VERSION,
        "format": FORMAT_MAGIC,
        "format_version": FORMAT_VERSION,
    }
    path = os.path.join(checkpoint_dir, METADATA_FILE)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(content, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointWriteError(checkpoint_dir, str(e)) from None


def read_metadata_json(checkpoint_dir: str) -> dict[str, Any]:
    """Check that ``checkpoint_dir`` is a complete checkpoint of a format we read; return metadata.json.

    Raises:
        CheckpointError: the directory is missing, has no ``metadata.json`` (an interrupted save), or was
            written by another backend or a newer format version.
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    path = os.path.join(checkpoint_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"incomplete checkpoint {checkpoint_dir}: no {METADATA_FILE} (the save was interrupted "
            "before it finished); load an earlier complete checkpoint instead"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt {path}: {e}") from e
    if meta.get("sharded_backend") != SHARDED_BACKEND:
        raise CheckpointError(
            f"{path}: sharded_backend is {meta.get('sharded_backend')!r}; only {SHARDED_BACKEND!r} is supported"
        )
    if meta.get("format", FORMAT_MAGIC) != FORMAT_MAGIC or meta.get("format_version", 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')} is not readable "
            f"by this code ({FORMAT_MAGIC!r} up to version {FORMAT_VERSION}); upgrade megatron"
        )
    return meta


def is_complete_checkpoint(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` (the last file a save writes)."""
    return os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILE))


def make_dir(checkpoint_dir: str) -> None:
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointWriteError(checkpoint_dir, str(e)) from None


def check_files(checkpoint_dir: str, keys: set[str] | None = None) -> Any:
    """Check that ``.metadata`` is readable and records a file for every saved chunk of ``keys``
    (default: every key, and then also that each tensor's chunks tile it), and that those files are
    all there and as long as ``.metadata`` records; return that metadata.

    Raises:
        CheckpointReadError: ``.metadata`` or a data file is missing, truncated or unreadable, or
            ``.metadata`` cannot serve a key; names the first file.
    """
    md = read_dcp_metadata(checkpoint_dir)
    raise_file_problems(checkpoint_dir, md, keys, coverage=keys is None)
    return md


def checkpoint_problems(
    checkpoint_dir: str, md: Any, keys: set[str] | None = None, coverage: bool = True
) -> list[str]:
    """Every problem of ``.metadata`` (``consistency.index_problems``) and of the data files (those of
    ``keys``, default all) that can be seen without reading a tensor: one line each, naming the file."""
    return index_problems(checkpoint_dir, md, keys, coverage) + file_problems(checkpoint_dir, md, keys)


def raise_file_problems(checkpoint_dir: str, md: Any, keys: set[str] | None, coverage: bool = False) -> None:
    """Raises CheckpointReadError naming the first of ``checkpoint_problems`` (if any)."""
    problems = checkpoint_problems(checkpoint_dir, md, keys, coverage)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointReadError(f"{problems[0]}{more}: the checkpoint is damaged")


def load_common_state(checkpoint_dir: str) -> dict:
    """The plain (non-sharded) values of a checkpoint, read locally by the calling rank alone.

    Raises:
        CheckpointError: not a complete checkpoint; CheckpointReadError: the file holding them is
            damaged, or a content they list is not in ``.metadata``.
    """
    read_metadata_json(checkpoint_dir)
    md = check_files(checkpoint_dir, {COMMON_STATE_KEY})
    common = dcp_load({}, [COMMON_STATE_KEY], checkpoint_dir, no_dist=True)[COMMON_STATE_KEY]
    raise_contents_problems(checkpoint_dir, md, common)
    return common


def raise_contents_problems(checkpoint_dir: str, md: Any, common: dict) -> None:
    """For a checkpoint whose common state lists its contents (``checkpoint_contents``: one that
    ``save_checkpoint`` wrote, every tensor covered): raises CheckpointReadError when ``.metadata``
    cannot serve one of its keys or holds no key of a listed content."""
    if CONTENTS_KEY not in common:
        return
    problems = index_problems(checkpoint_dir, md) + contents_problems(checkpoint_dir, md, common)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointReadError(f"{problems[0]}{more}: the checkpoint is damaged")
