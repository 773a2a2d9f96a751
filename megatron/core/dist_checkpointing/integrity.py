"""``save(verify_integrity=True)`` / ``load(verify_integrity=True)``: a SHA-256 manifest of the
checkpoint's files (``integrity.json``), written by rank 0 after a save and checked before a load."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError, CheckpointReadError, CheckpointWriteError

INTEGRITY_FNAME = "integrity.json"
_ALGORITHM = "sha256"
_CHUNK = 1 << 20


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def save_integrity_manifest(checkpoint_dir: str) -> None:
    """Hash every file of ``checkpoint_dir`` (the manifest aside) into ``integrity.json``; one rank calls it.

    Raises:
        CheckpointWriteError: a file cannot be read or the manifest written.
    """
    try:
        names = sorted(
            n
            for n in os.listdir(checkpoint_dir)
            if n != INTEGRITY_FNAME and os.path.isfile(os.path.join(checkpoint_dir, n))
        )
        files = {n: _sha256(os.path.join(checkpoint_dir, n)) for n in names}
        with open(os.path.join(checkpoint_dir, INTEGRITY_FNAME), "w") as f:
            json.dump({"algorithm": _ALGORITHM, "files": files}, f, indent=2)
    except OSError as e:
        raise CheckpointWriteError(checkpoint_dir, str(e)) from None


def integrity_problems(checkpoint_dir: str) -> list[str]:
    """One line per file whose hash differs from the manifest, or that is missing (empty: all match)."""
    path = os.path.join(checkpoint_dir, INTEGRITY_FNAME)
    if not os.path.isfile(path):
        return [f"{path} is missing: save with verify_integrity=True before loading with it"]
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("algorithm") != _ALGORITHM:
        return [f"{path}: hash algorithm {manifest.get('algorithm')!r} is not {_ALGORITHM!r}"]
    problems = []
    for name, expected in manifest["files"].items():
        try:
            actual = _sha256(os.path.join(checkpoint_dir, name))
        except OSError as e:
            problems.append(f"{name}: cannot be read ({e})")
            continue
        if actual != expected:
            problems.append(
                f"{name}: SHA-256 {actual[:16]}... differs from the manifest's {expected[:16]}..."
            )
    return problems


def verify_integrity_manifest(checkpoint_dir: str, process_group: Any = None) -> None:
    """Collective: rank 0 checks the manifest, every rank raises the same error on a mismatch.

    Raises:
        CheckpointReadError: a file differs from (or is missing against) ``integrity.json``;
        CheckpointError: there is no manifest.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    problems: list[Any] = [None]
    if not distributed or dist.get_rank(process_group) == 0:
        problems = [integrity_problems(checkpoint_dir)]
    if distributed:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(problems, src=src, group=process_group)
    found: list[str] = problems[0] or []
    if not found:
        return
    if found[0].endswith("before loading with it"):
        raise CheckpointError(found[0])
    raise CheckpointReadError(f"checkpoint {checkpoint_dir} fails its integrity check: " + "; ".join(found))
