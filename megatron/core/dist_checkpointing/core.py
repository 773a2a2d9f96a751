"""The checkpoint directory's format record (``metadata.json``) and the base error of checkpointing.

``metadata.json`` names the backend that wrote the sharded part (``sharded_backend``) and its version;
it is the last file a save writes, so its presence marks a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """Base of every error that ``dist_checkpointing`` raises about a checkpoint or a sharded state dict.

    Our concrete errors (``errors.CheckpointError`` and its subclasses) are also ``ValueError``s, so
    both ``except CheckpointingException`` and ``except ValueError`` catch them.
    """


@dataclass
class CheckpointingConfig:
    """What ``metadata.json`` records: the sharded backend (always ``torch_dist`` here) and its version."""

    sharded_backend: str
    sharded_backend_version: int = 1


def maybe_load_config(checkpoint_dir: str) -> CheckpointingConfig | None:
    """The checkpoint's ``metadata.json`` as a ``CheckpointingConfig``; None when ``checkpoint_dir`` is empty
    or holds no ``metadata.json`` (not a distributed checkpoint, or an interrupted save).

    Fields of ``metadata.json`` that ``CheckpointingConfig`` does not know are ignored.
    """
    if not checkpoint_dir:
        return None
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        content = json.load(f)
    known = {f.name for f in dataclasses.fields(CheckpointingConfig)}
    return CheckpointingConfig(**{k: v for k, v in content.items() if k in known})


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds a readable ``metadata.json`` (a complete distributed checkpoint)."""
    return maybe_load_config(checkpoint_dir) is not None
