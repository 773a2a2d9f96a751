"""What a checkpoint's DCP index (``.metadata``) must say of itself for every tensor to be readable, and
what the checkpoint's own list of contents must find there.

Checked from ``.metadata`` alone (no tensor is read): every saved chunk of a tensor and every object has
a storage entry (a file, an offset, a length); a tensor's chunks lie inside its global shape, do not
overlap and together cover it (for checkpoints that record their contents, which ``save_checkpoint``
writes with every tensor covered); a content the common state lists (``checkpoint_contents``: ``model``,
``optimizer``, ``rng_state``, ``fp8_state``) has keys in ``.metadata``. The files themselves (missing,
shorter than recorded) are ``torch_dist.file_problems``. Each problem is one line naming the file.

Keys are sorted into components by their names, as the savers name them: ``optimizer.*`` (the
optimizer's state and ``optimizer.common``), ``rng_state/*``, ``*.amax_history`` / ``*.initialized``
(FP8 scaling state), ``common_state`` (the plain values); any other tensor is the model's.
"""

from __future__ import annotations

import math
import os
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from megatron.core.dist_checkpointing.torch_dist import DCP_METADATA_FILE

CONTENTS_KEY = "checkpoint_contents"  # the common value listing what a checkpoint holds
COMMON_STATE_KEY = "common_state"
COMPONENTS = ("model", "optimizer", "rng", "fp8", "common")
FP8_SUFFIXES = (".amax_history", ".initialized")
# content name (as checkpoint_contents lists it) -> the component its keys belong to
CONTENT_COMPONENTS = {"model": "model", "optimizer": "optimizer", "rng_state": "rng", "fp8_state": "fp8"}


def component(key: str, is_tensor: bool = True) -> str:
    """The component (one of ``COMPONENTS``) a saved key belongs to, by the savers' naming."""
    if key == COMMON_STATE_KEY:
        return "common"
    if key.startswith("optimizer.") or key.startswith("optimizer/"):
        return "optimizer"
    if key.startswith("rng_state"):
        return "rng"
    if is_tensor and key.endswith(FP8_SUFFIXES):
        return "fp8"
    return "model" if is_tensor else "common"


def index_problems(
    checkpoint_dir: str, md: Metadata, keys: set[str] | None = None, coverage: bool = True
) -> list[str]:
    """One line per key (of ``keys``, default all) that ``.metadata`` cannot serve: a chunk or object
    without a storage entry; with ``coverage``, chunks outside the shape, overlapping or not covering
    it (``dist_checkpointing.save(validate_access_integrity=False)`` may save tensors in part)."""
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    storage = getattr(md, "storage_data", None) or {}
    problems = []
    for key, item in sorted(md.state_dict_metadata.items()):
        if keys is not None and key not in keys:
            continue
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                problems.append(f"{path} names object {key} but records no file holding it")
            continue
        if not isinstance(item, TensorStorageMetadata):
            problems.append(f"{path}: entry {key} is a {type(item).__name__}, not a tensor or an object")
            continue
        unstored = [c for c in item.chunks if MetadataIndex(key, c.offsets) not in storage]
        if unstored:
            problems.append(
                f"{path} names tensor {key} but records no file holding its chunk at offset "
                f"{tuple(unstored[0].offsets)} ({len(unstored)} of {len(item.chunks)} chunks)"
            )
            continue
        cover = coverage_problem(tuple(item.size), item.chunks) if coverage else None
        if cover:
            problems.append(f"{path}: tensor {key} {tuple(item.size)}: {cover}")
    return problems


def coverage_problem(shape: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> str | None:
    """Why ``chunks`` do not tile ``shape`` exactly (None when they do): in bounds, disjoint, and
    their volumes adding up to the tensor's (which, for disjoint chunks inside it, means covering it)."""
    for c in chunks:
        ends = [o + s for o, s in zip(c.offsets, c.sizes)]
        if (
            len(c.offsets) != len(shape)
            or any(o < 0 for o in c.offsets)
            or any(e > d for e, d in zip(ends, shape))
        ):
            return f"its chunk at offset {tuple(c.offsets)} of size {tuple(c.sizes)} lies outside its shape"
    saved = sum(math.prod(c.sizes) for c in chunks)
    numel = math.prod(shape)
    if saved != numel:
        return f"its saved chunks hold {saved} of its {numel} elements (a part of it was not saved)"
    pair = _overlapping_pair(chunks)
    if pair is not None:
        a, b = pair
        return (
            f"its chunks at offsets {tuple(a.offsets)} and {tuple(b.offsets)} overlap, "
            "so a part of it was not saved"
        )
    return None


def _overlapping_pair(
    chunks: list[ChunkStorageMetadata],
) -> tuple[ChunkStorageMetadata, ChunkStorageMetadata] | None:
    """Two chunks that share an element, if any (a sweep along dimension 0)."""
    if len(chunks) < 2 or len(chunks[0].offsets) == 0:
        return None
    order = sorted(chunks, key=lambda c: c.offsets[0])
    active: list[ChunkStorageMetadata] = []
    for c in order:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if all(
                ao < co + cs and co < ao + asz
                for ao, asz, co, cs in zip(a.offsets, a.sizes, c.offsets, c.sizes)
            ):
                return a, c
        active.append(c)
    return None


def contents_problems(checkpoint_dir: str, md: Metadata, common: dict[str, Any]) -> list[str]:
    """One line per content that ``common[CONTENTS_KEY]`` lists but ``.metadata`` holds no key of (a
    content kept in the common state itself, such as the scheduler, must be there)."""
    listed = common.get(CONTENTS_KEY)
    if not isinstance(listed, (list, tuple)):
        return []
    present = {
        component(key, isinstance(item, TensorStorageMetadata))
        for key, item in md.state_dict_metadata.items()
    }
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    problems = []
    for name in listed:
        wanted = CONTENT_COMPONENTS.get(name)
        if wanted is None:
            if name not in common:
                problems.append(
                    f"{path}: the common state lists {name!r} in {CONTENTS_KEY} but does not hold it"
                )
        elif wanted not in present:
            problems.append(
                f"{path} holds no {name} keys, though the common state lists {name!r} in {CONTENTS_KEY}"
            )
    return problems
