"""The ``torch_dist`` strategies under Megatron-Core's names: option holders that ``save`` / ``load``
accept, whose own ``save`` / ``load`` call those entry points (one mechanism: ``torch_dist.py``).

Options that tune Megatron's own writer (threads, cached plans, separation hints, shared memory) are
accepted and have no effect: every rank writes one file per save, and plans are not cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.metadata import (
    load_sharded_metadata,
    load_tensors_metadata,
    tensors_metadata,
)
from megatron.core.dist_checkpointing.sharded_io import read_sharded, write_sharded

BACKEND = "torch_dist"


def _check_backend(backend: str, version: int) -> None:
    if backend != BACKEND:
        raise ConfigError(
            f"backend={backend!r}: only the {BACKEND!r} checkpoint backend is implemented; use {BACKEND!r}",
            params=("backend",),
        )
    if version != 1:
        raise ConfigError(
            f"version={version}: the {BACKEND!r} backend has version 1 only; use version=1",
            params=("version",),
        )


class TorchDistSaveShardedStrategy:
    """Saves sharded tensors and objects with PyTorch DCP (``backend`` ``torch_dist``, ``version`` 1).

    Raises:
        ConfigError: another backend or version.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 1,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
        cpu_shm_mode: bool = False,
    ) -> None:
        _check_backend(backend, version)
        self.backend, self.version = backend, version
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint
        self.cpu_shm_mode = cpu_shm_mode

    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """``dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=self)``: a
        complete checkpoint (common values and ``metadata.json`` included)."""
        write_sharded(sharded_state_dict, str(checkpoint_dir))

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path, async_strategy: str = "nvrx"
    ) -> Any:
        """Refused: asynchronous saving is not implemented (use ``save``)."""
        raise ConfigError(
            "async_save: asynchronous checkpoint saving is not implemented; call save() instead"
        )


class TorchDistLoadShardedStrategy:
    """Loads (and reshards) sharded tensors and objects written by the ``torch_dist`` backend."""

    def __init__(
        self,
        cache_metadata: bool = False,
        stream_ckpt_dequant: bool = True,
        checkpoint_name: str | Path | None = None,
    ) -> None:
        self.cache_metadata = cache_metadata
        self.stream_ckpt_dequant = stream_ckpt_dequant
        self.checkpoint_name = checkpoint_name

    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path, async_strategy: str = "mcore"
    ) -> StateDict:
        """``dist_checkpointing.load(sharded_state_dict, checkpoint_dir, sharded_strategy=self)``."""
        return read_sharded(sharded_state_dict, str(checkpoint_dir))

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> dict:
        return (
            tensors_metadata(metadata) if metadata is not None else load_tensors_metadata(str(checkpoint_dir))
        )

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict:
        return load_sharded_metadata(str(checkpoint_dir))


def get_default_save_sharded_strategy(
    backend: str = BACKEND, version: int = 1
) -> TorchDistSaveShardedStrategy:
    """The save strategy of ``backend`` (only ``torch_dist``).

    Raises:
        ConfigError: another backend or version.
    """
    return TorchDistSaveShardedStrategy(backend=backend, version=version)


def get_default_load_sharded_strategy(
    checkpoint_dir: str | Path | None = None,
) -> TorchDistLoadShardedStrategy:
    """The load strategy for ``checkpoint_dir`` (every checkpoint here is ``torch_dist``)."""
    return TorchDistLoadShardedStrategy(checkpoint_name=checkpoint_dir)
