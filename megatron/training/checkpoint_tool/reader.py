"""One of our ``torch_dist`` checkpoints, read offline in one process, one tensor at a time.

Whatever layout saved it (tp, pp, dp, the distributed optimizer, FSDP2), every tensor is stored under
its global key with its global shape (``dist_checkpointing``), so reading tensor ``k`` whole is one
DCP read of the blocks that make it up: memory holds one tensor at a time, never the model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.dist_checkpointing.files import check_files, load_common_state, read_metadata_json
from megatron.core.dist_checkpointing.torch_dist import dcp_load, read_dcp_metadata
from megatron.training.checkpoint_dirs import (
    TRACKER_FILENAME,
    iteration_dir,
    read_tracker,
    resolve,
    split_iteration_dir,
)


def find_checkpoint(path: str, ckpt_step: int | None = None) -> tuple[str, int | None]:
    """(the directory holding one complete checkpoint, its iteration) for ``path``: a save directory
    (its tracker's iteration, or ``ckpt_step``) or one ``iter_XXXXXXX`` directory.

    Raises:
        CheckpointError: ``path`` is neither, or names an incomplete checkpoint.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory (give a save directory or one iter_XXXXXXX in it)")
    parent, iteration = split_iteration_dir(path)
    if iteration is None:
        iteration = ckpt_step if ckpt_step is not None else read_tracker(path)
        if iteration is None:
            raise CheckpointError(
                f"{path} holds no {TRACKER_FILENAME} and is not an iter_XXXXXXX checkpoint directory"
            )
        ckpt_dir = resolve(iteration_dir(path, iteration))
    else:
        ckpt_dir = path
    read_metadata_json(ckpt_dir)  # raises on an incomplete checkpoint, naming it
    return ckpt_dir, iteration


class SavedCheckpoint:
    """A complete checkpoint opened for reading (``find_checkpoint``'s rules for ``path``).

    Attributes:
        dir: the ``iter_XXXXXXX`` directory.
        iteration: its iteration (None for a directory without a number in its name).
        common: the plain values saved beside the tensors (iteration, consumed samples, ``args``, ...).
        tensors: ``{key: (global shape, dtype)}`` of every saved tensor, sorted by key.
        objects: keys of the saved non-tensor objects (RNG states, ...).
    """

    def __init__(self, path: str, ckpt_step: int | None = None, check: bool = True) -> None:
        self.dir, self.iteration = find_checkpoint(path, ckpt_step)
        self.metadata = check_files(self.dir) if check else read_dcp_metadata(self.dir)
        self.common: dict[str, Any] = load_common_state(self.dir)
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.objects: list[str] = []
        for key, md in sorted(self.metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                self.tensors[key] = (tuple(md.size), md.properties.dtype)
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(key)

    @property
    def args(self) -> dict[str, Any]:
        """The saved run's ``args``: the shape-defining flags at the top level, ``config`` (the run's
        configs by section, ``RunConfig.to_dict``) below."""
        return self.common.get("args") or {}

    @property
    def config(self) -> dict[str, dict[str, Any]]:
        """``args['config']``: {section: {field: value}}; empty for a checkpoint that does not record it."""
        return self.args.get("config") or {}

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``key`` (in its saved dtype, or cast to ``dtype``).

        Raises:
            KeyError: the checkpoint holds no tensor ``key``.
        """
        shape, saved_dtype = self.tensors[key]
        out = torch.empty(shape, dtype=saved_dtype)
        dcp_load({key: [((0,) * len(shape), out)]}, [], self.dir, no_dist=True)
        return out if dtype is None else out.to(dtype)

    def read_object(self, key: str) -> Any:
        """A saved non-tensor object (e.g. an RNG state) by key."""
        return dcp_load({}, [key], self.dir, no_dist=True)[key]
