"""What a checkpoint holds, read without loading its tensors: the saved tensors and objects as data-less
``ShardedTensor`` / ``ShardedObject``, the common values and the ``content_metadata`` of ``save``."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.files import COMMON_STATE_KEY, load_common_state, read_metadata_json
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata

CONTENT_METADATA_KEY = "content_metadata"

# key (tensors) or unique key (objects) -> data-less ShardedTensor / ShardedObject
CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]


def load_common_state_dict(checkpoint_dir: str) -> StateDict:
    """The checkpoint's common (non-sharded) values, read by the calling rank alone (no collective).

    Raises:
        CheckpointError: not a complete checkpoint. CheckpointReadError: its file is damaged.
    """
    return load_common_state(str(checkpoint_dir))


def tensors_metadata(md: Metadata) -> dict[str, ShardedTensor]:
    """Each saved tensor as a data-less, unsharded ShardedTensor (global shape and dtype)."""
    out = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            shape = tuple(entry.size)
            out[key] = ShardedTensor(
                key, None, entry.properties.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape)
            )
    return out


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy: Any = None) -> dict[str, ShardedTensor]:
    """The checkpoint's tensors by key, as data-less ShardedTensors covering the whole global tensor
    (``global_shape``, ``dtype``); ``sharded_strategy`` is accepted and unused (one backend).

    Raises:
        CheckpointError: not a complete checkpoint. CheckpointReadError: ``.metadata`` is damaged.
    """
    read_metadata_json(str(checkpoint_dir))
    return tensors_metadata(read_dcp_metadata(str(checkpoint_dir)))


def load_sharded_metadata(checkpoint_dir: str, sharded_strategy: Any = None) -> CkptShardedMetadata:
    """``load_tensors_metadata`` plus every saved ShardedObject (data-less) by its unique key; the
    internal ``common_state`` object is not listed."""
    read_metadata_json(str(checkpoint_dir))
    md = read_dcp_metadata(str(checkpoint_dir))
    out: CkptShardedMetadata = {}
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata) and key != COMMON_STATE_KEY:
            out[key] = ShardedObject.empty_from_unique_key(key)
    out.update(tensors_metadata(md))
    return out


def checkpoint_keys(md: Metadata) -> set[str]:
    """The keys (tensor keys, object keys without their shard part) a checkpoint holds."""
    return {
        key if isinstance(entry, TensorStorageMetadata) else ShardedObject.empty_from_unique_key(key).key
        for key, entry in md.state_dict_metadata.items()
        if key != COMMON_STATE_KEY
    }


def load_content_metadata(
    checkpoint_dir: str | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The ``content_metadata`` given to ``save`` (None if none was), from ``checkpoint_dir`` or from a
    state dict that ``load`` / ``load_common_state_dict`` already returned.

    Raises:
        ConfigError: neither ``checkpoint_dir`` nor ``preloaded_state_dict`` given.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ConfigError(
                "load_content_metadata: give checkpoint_dir or preloaded_state_dict",
                params=("checkpoint_dir", "preloaded_state_dict"),
            )
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)
