"""Checks made before a save writes anything and before a load reads anything.

Save: every global tensor must be covered exactly once by main-replica blocks, and every rank must
agree on its global shape and dtype. Load: each requested key must exist (when strict) with the
requested global shape. The functions return messages instead of raising so that the caller can
gather them from all ranks and raise the same error everywhere (a rank that raised alone would leave
the others waiting in a collective).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strict import StrictHandling, parse_strict_flag

__all__ = ["LoadRequest", "StrictHandling", "parse_strict_flag", "validate_load_request", "validate_save"]

# (offset, local shape) of one block
_Block = tuple[tuple[int, ...], tuple[int, ...]]


def _overlap(a: _Block, b: _Block) -> bool:
    (a_off, a_shape), (b_off, b_shape) = a, b
    if 0 in a_shape or 0 in b_shape:
        return False
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape))


def _local_errors(leaves: list[ShardedTensor | ShardedObject]) -> list[str]:
    errors = []
    for t in leaves:
        if not isinstance(t, ShardedTensor):
            continue
        if not (len(t.global_shape) == len(t.global_offset) == t.local_data().dim()):
            errors.append(
                f"{t.key}: global_shape {tuple(t.global_shape)}, global_offset {tuple(t.global_offset)} and "
                f"local shape {t.local_shape} must have the same number of axes"
            )
            continue
        try:
            t.validate()
        except ValueError as e:
            errors.append(str(e))
    return errors


def validate_save(
    leaves: list[ShardedTensor | ShardedObject],
    reserved_keys: set[str],
    gather: Callable[[Any], list[Any]],
    check_access: bool = True,
) -> list[str]:
    """Collective (through ``gather``): problems that would make the saved checkpoint wrong.

    ``check_access`` (``save(validate_access_integrity=...)``): also require every element of every
    global tensor to have exactly one main replica, every object unique key exactly one, and a
    sharded object's grid (``global_shape``) all its shards."""
    errors = _local_errors(leaves)
    tensors = [
        (
            t.key,
            tuple(t.global_shape),
            str(t.dtype),
            tuple(t.global_offset),
            t.local_shape,
            is_main_replica(t.replica_id),
        )
        for t in leaves
        if isinstance(t, ShardedTensor)
    ]
    objects = [
        (
            o.unique_key,
            is_main_replica(o.replica_id),
            o.key,
            o.num_shards if o.global_shape and not o.shard_key else 0,
        )
        for o in leaves
        if isinstance(o, ShardedObject)
    ]
    all_ranks = gather((tensors, objects))

    shapes: dict[str, set[tuple[tuple[int, ...], str]]] = defaultdict(set)
    blocks: dict[str, list[_Block]] = defaultdict(list)
    obj_writers: dict[str, int] = defaultdict(int)
    grids: dict[str, tuple[int, set[str]]] = {}  # object key -> (shards of its grid, unique keys seen)
    for rank_tensors, rank_objects in all_ranks:
        for key, shape, dtype, offset, local_shape, main in rank_tensors:
            shapes[key].add((shape, dtype))
            if main:
                blocks[key].append((offset, local_shape))
        for key, main, grid_key, num_shards in rank_objects:
            obj_writers[key] += int(main)
            if num_shards:
                grids.setdefault(grid_key, (num_shards, set()))[1].add(key)

    for key in sorted(set(shapes) & (set(obj_writers) | reserved_keys)):
        errors.append(f"{key}: used both as a tensor key and as an object (or reserved) key")
    for key in sorted(set(obj_writers) & reserved_keys):
        errors.append(f"{key}: object key is reserved")
    for key, variants in sorted(shapes.items()):
        if len(variants) > 1:
            errors.append(f"{key}: ranks disagree on (global shape, dtype): {sorted(variants)}")
            continue
        if not check_access:
            continue
        ((shape, _),) = variants
        key_blocks = sorted(blocks[key])
        for i, a in enumerate(key_blocks):
            for b in key_blocks[i + 1 :]:
                if _overlap(a, b):
                    errors.append(
                        f"{key}: main-replica blocks overlap: offset {a[0]} size {a[1]} and "
                        f"offset {b[0]} size {b[1]}; give all but one copy a nonzero replica_id"
                    )
        covered = sum(math.prod(s) for _, s in key_blocks)
        if covered != math.prod(shape) and not any(
            "overlap" in e and e.startswith(key + ":") for e in errors
        ):
            errors.append(
                f"{key}: main replicas cover {covered} of {math.prod(shape)} elements of global shape "
                f"{shape}; each element needs exactly one writer (replica_id 0)"
            )
    if not check_access:
        return errors
    for key, writers in sorted(obj_writers.items()):
        if writers != 1:
            errors.append(f"object {key}: {writers} main replicas (replica_id 0); exactly one is required")
    for key, (num_shards, seen) in sorted(grids.items()):
        if len(seen) != num_shards:
            errors.append(
                f"object {key}: {len(seen)} of the {num_shards} shards of its global_shape are saved"
            )
    return errors


@dataclass
class LoadRequest:
    """What one rank will read: destination views (with global offsets) by key, and leaves left out."""

    errors: list[str] = field(default_factory=list)
    skipped: set[int] = field(default_factory=set)  # id() of leaves not loaded (non-strict, missing)
    blocks: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = field(default_factory=dict)


def _clipped_view(t: ShardedTensor, saved_shape: tuple[int, ...]) -> torch.Tensor | None:
    """The part of ``t.data`` inside the saved global extent (None if nothing of it was saved)."""
    view = t.local_data().detach()
    for dim, (off, size) in enumerate(zip(t.global_offset, saved_shape)):
        length = min(view.shape[dim], size - off)
        if length <= 0:
            return None
        view = view.narrow(dim, 0, length)
    return view


def validate_load_request(
    leaves: list[ShardedTensor | ShardedObject], md: Metadata, strict: bool
) -> LoadRequest:
    """Match this rank's request against the checkpoint's DCP metadata."""
    req = LoadRequest(errors=_local_errors(leaves))
    saved = md.state_dict_metadata
    for leaf in leaves:
        key = leaf.key if isinstance(leaf, ShardedTensor) else leaf.unique_key
        entry = saved.get(key)
        is_tensor = isinstance(leaf, ShardedTensor)
        if entry is None or isinstance(entry, TensorStorageMetadata) != is_tensor:
            req.skipped.add(id(leaf))
            if strict:
                kind = "tensor" if is_tensor else "object"
                req.errors.append(f"{kind} {key!r} is not in the checkpoint")
            continue
        if not isinstance(leaf, ShardedTensor):
            continue
        assert isinstance(entry, TensorStorageMetadata)
        saved_shape = tuple(entry.size)
        if saved_shape != tuple(leaf.global_shape):
            if not leaf.allow_shape_mismatch or len(saved_shape) != len(leaf.global_shape):
                req.errors.append(
                    f"{key}: global shape in checkpoint {saved_shape} != requested "
                    f"{tuple(leaf.global_shape)} (a checkpoint of another model shape?)"
                )
                continue
        view = _clipped_view(leaf, saved_shape)
        if view is None:
            continue
        req.blocks.setdefault(key, []).append((tuple(leaf.global_offset), view))
    return req
