"""Save and load sharded state dicts (``torch_dist`` format).

A sharded state dict is a nested dict (lists allowed) whose leaves are ``ShardedTensor``,
``ShardedObject`` or plain values. Plain values are *common*: rank 0 writes them once, as one pickled
object ``common_state`` inside the DCP checkpoint. A checkpoint directory holds DCP's files
(``.metadata``, ``__{rank}_{n}.distcp``) and our ``metadata.json``, written last: its presence marks a
complete checkpoint.

A file that cannot be written (disk full, quota, permissions) is a ``CheckpointWriteError``; a checkpoint
to load whose files are missing, truncated or unreadable is a ``CheckpointReadError``; both are one line
naming the file, raised before any tensor is read when the damage can be seen from the file sizes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointReadError, CheckpointWriteError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.torch_dist import dcp_load, dcp_save, file_problems, read_dcp_metadata
from megatron.core.dist_checkpointing.validation import validate_load_request, validate_save

METADATA_FILE = "metadata.json"
SHARDED_BACKEND = "torch_dist"
SHARDED_BACKEND_VERSION = 1
FORMAT_MAGIC = "megatron-dist-checkpoint"
FORMAT_VERSION = 1
COMMON_STATE_KEY = "common_state"

_MISSING = object()
_Leaf = ShardedTensor | ShardedObject


def _iter_sharded(tree: Any) -> Iterator[_Leaf]:
    """Every ShardedTensor / ShardedObject leaf of a nested dict/list, in a deterministic order."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _iter_sharded(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _iter_sharded(value)
    elif isinstance(tree, ShardedTensor | ShardedObject):
        yield tree


def sharded_tensors(tree: Any) -> list[ShardedTensor]:
    """The ShardedTensor leaves of a nested dict/list (a sharded state dict), in a deterministic order."""
    return [leaf for leaf in _iter_sharded(tree) if isinstance(leaf, ShardedTensor)]


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
        if t.data.is_floating_point():
            per_device.setdefault(t.data.device, []).append(_is_finite(t.data))
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend(process_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.ones((), dtype=torch.int32, device=device)
    for flags in per_device.values():  # one copy to the reduction's device per device, no sync per tensor
        flag &= torch.stack(flags).all().to(device=device, dtype=torch.int32)
    if _group_size(process_group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
    return bool(flag.item())


def _strip_sharded(tree: Any) -> Any:
    """The plain (common) part of a tree; sharded leaves dropped (``None`` placeholders in lists)."""
    if isinstance(tree, dict):
        out = {k: _strip_sharded(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not _MISSING}
    if isinstance(tree, list):
        return [None if v is _MISSING else v for v in map(_strip_sharded, tree)]
    if isinstance(tree, ShardedTensor | ShardedObject):
        return _MISSING
    return tree


def _group_size(process_group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


def _rank(process_group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group)
    return 0


def _all_gather(obj: Any, process_group: Any) -> list[Any]:
    if _group_size(process_group) == 1:
        return [obj]
    out: list[Any] = [None] * _group_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _barrier(process_group: Any) -> None:
    if _group_size(process_group) > 1:
        dist.barrier(group=process_group)


def _raise_if_any(errors: list[str], process_group: Any, prefix: str) -> None:
    """Collective: every rank raises the same ValueError if any rank found a problem."""
    all_errors = sorted({e for rank_errors in _all_gather(errors, process_group) for e in rank_errors})
    if all_errors:
        shown = all_errors[:20]
        more = f" (and {len(all_errors) - len(shown)} more)" if len(all_errors) > len(shown) else ""
        raise ValueError(prefix + "\n  " + "\n  ".join(shown) + more)


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
        ValueError: the directory is missing, has no ``metadata.json`` (an interrupted save), or was
            written by another backend or a newer format version.
    """
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"checkpoint directory {checkpoint_dir} does not exist")
    path = os.path.join(checkpoint_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"incomplete checkpoint {checkpoint_dir}: no {METADATA_FILE} (the save was interrupted "
            "before it finished); load an earlier complete checkpoint instead"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from e
    if meta.get("sharded_backend") != SHARDED_BACKEND:
        raise ValueError(
            f"{path}: sharded_backend is {meta.get('sharded_backend')!r}; only {SHARDED_BACKEND!r} is supported"
        )
    if meta.get("format", FORMAT_MAGIC) != FORMAT_MAGIC or meta.get("format_version", 1) > FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')} is not readable "
            f"by this code ({FORMAT_MAGIC!r} up to version {FORMAT_VERSION}); upgrade megatron"
        )
    return meta


def is_complete_checkpoint(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` (the last file a save writes)."""
    return os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILE))


def save(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    common_state: dict | None = None,
    process_group: Any = None,
) -> None:
    """Collectively save a sharded state dict to ``checkpoint_dir`` (created if needed).

    Each rank writes the ShardedTensor blocks and ShardedObjects it holds as main replica; rank 0
    writes the plain values of its ``sharded_state_dict`` merged with ``common_state``. Before any
    file is written, all ranks check together that every global tensor is covered exactly once by
    main replicas with one global shape and dtype. ``metadata.json`` is written after a barrier, last
    (an existing one is removed first, so a directory being overwritten never looks complete).

    Raises:
        ValueError: a coverage, overlap, shape or key problem (on every rank, before writing), or a key
            of ``common_state`` that also appears among the plain values.
        CheckpointWriteError: a file could not be written (on every rank when DCP's write failed on any).
    """
    common = _strip_sharded(sharded_state_dict)
    for key, value in (common_state or {}).items():
        if key in common:
            raise ValueError(f"common_state key {key!r} is also a key of the sharded state dict")
        common[key] = value
    leaves = list(_iter_sharded(sharded_state_dict))
    errors = validate_save(leaves, reserved_keys={COMMON_STATE_KEY}, gather=lambda x: _all_gather(x, process_group))
    _raise_if_any(errors, process_group, f"cannot save checkpoint to {checkpoint_dir}:")

    tensors = [t for t in leaves if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
    objects = {o.unique_key: o.data for o in leaves if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)}
    if _rank(process_group) == 0:
        objects[COMMON_STATE_KEY] = common
        _make_dir(checkpoint_dir)
        if is_complete_checkpoint(checkpoint_dir):  # overwriting: never look complete while half-written
            os.remove(os.path.join(checkpoint_dir, METADATA_FILE))
    _barrier(process_group)
    _make_dir(checkpoint_dir)
    dcp_save(tensors, objects, checkpoint_dir, process_group)
    _barrier(process_group)
    if _rank(process_group) == 0:
        write_metadata_json(checkpoint_dir)
    _barrier(process_group)


def _make_dir(checkpoint_dir: str) -> None:
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointWriteError(checkpoint_dir, str(e)) from None


def check_files(checkpoint_dir: str, keys: set[str] | None = None) -> Any:
    """Check that the files holding ``keys`` (default: every file) are all there and as long as the
    checkpoint's ``.metadata`` records; return that metadata.

    Raises:
        CheckpointReadError: ``.metadata`` or a data file is missing, truncated or unreadable; names the first.
    """
    md = read_dcp_metadata(checkpoint_dir)
    _raise_file_problems(checkpoint_dir, md, keys)
    return md


def _raise_file_problems(checkpoint_dir: str, md: Any, keys: set[str] | None) -> None:
    problems = file_problems(checkpoint_dir, md, keys)
    if problems:
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise CheckpointReadError(f"{problems[0]}{more}: the checkpoint is damaged")


def load_common_state(checkpoint_dir: str) -> dict:
    """The plain (non-sharded) values of a checkpoint, read locally by the calling rank alone.

    Raises:
        ValueError: not a complete checkpoint; CheckpointReadError: the file holding them is damaged.
    """
    read_metadata_json(checkpoint_dir)
    check_files(checkpoint_dir, {COMMON_STATE_KEY})
    return dcp_load({}, [COMMON_STATE_KEY], checkpoint_dir, no_dist=True)[COMMON_STATE_KEY]


def _build_result(request: Any, common: Any, loaded: dict[int, Any]) -> Any:
    """The request's nesting with sharded leaves replaced and plain leaves taken from the checkpoint."""
    if isinstance(request, dict):
        out = dict(common) if isinstance(common, dict) else {}
        for key, value in request.items():
            sub = common.get(key, _MISSING) if isinstance(common, dict) else _MISSING
            built = _build_result(value, sub, loaded)
            if built is _MISSING:
                out.pop(key, None)
            else:
                out[key] = built
        return out
    if isinstance(request, list):
        subs = common if isinstance(common, list) and len(common) == len(request) else [_MISSING] * len(request)
        return [_build_result(v, s, loaded) for v, s in zip(request, subs)]
    if isinstance(request, ShardedTensor | ShardedObject):
        return loaded.get(id(request), _MISSING)
    return request if common is _MISSING else common


def load(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    strict: bool = True,
    process_group: Any = None,
) -> dict:
    """Collectively load the slices each rank asks for; return them in the request's nesting.

    Each ShardedTensor's ``data`` is filled in place with its global block (read from whichever saved
    chunks overlap it, so the saving layout does not matter) and appears in the result as that tensor.
    Values are cast to ``data``'s dtype. With ``allow_shape_mismatch`` only the part of the block that
    lies inside the saved global shape is read. ShardedObjects become their saved value. The result
    also holds every common value of the checkpoint (checkpoint values win over plain request values).

    Raises:
        ValueError: missing directory, incomplete checkpoint, a requested key not in the checkpoint
            (``strict``; otherwise it is left out of the result) or a global shape that differs, on
            every rank. The message names the directory and the keys.
        CheckpointReadError: a file this rank reads is missing, truncated or unreadable (named).
    """
    read_metadata_json(checkpoint_dir)
    dcp_md = read_dcp_metadata(checkpoint_dir)
    leaves = list(_iter_sharded(sharded_state_dict))
    req = validate_load_request(leaves, dcp_md, strict)
    _raise_if_any(req.errors, process_group, f"cannot load checkpoint {checkpoint_dir}:")
    object_keys = sorted({o.unique_key for o in leaves if isinstance(o, ShardedObject) and id(o) not in req.skipped})
    _raise_file_problems(checkpoint_dir, dcp_md, {COMMON_STATE_KEY, *object_keys, *req.blocks})
    objects = dcp_load(req.blocks, [COMMON_STATE_KEY, *object_keys], checkpoint_dir, process_group)
    loaded: dict[int, Any] = {}
    for leaf in leaves:
        if id(leaf) in req.skipped:
            continue
        loaded[id(leaf)] = leaf.data if isinstance(leaf, ShardedTensor) else objects[leaf.unique_key]
    return _build_result(sharded_state_dict, objects[COMMON_STATE_KEY], loaded)
