"""Distributed checkpointing: sharded state dicts saved and loaded (and resharded) with PyTorch DCP.

    sd = model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sd, checkpoint_dir=d)
    model.load_state_dict(dist_checkpointing.load(sharded_state_dict=sd, checkpoint_dir=d))
"""

from megatron.core.dist_checkpointing.errors import CheckpointReadError, CheckpointWriteError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.serialization import (
    METADATA_FILE,
    all_finite,
    check_files,
    is_complete_checkpoint,
    load,
    load_common_state,
    read_metadata_json,
    save,
    sharded_tensors,
)

__all__ = [
    "METADATA_FILE",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ShardedObject",
    "ShardedTensor",
    "all_finite",
    "check_files",
    "is_complete_checkpoint",
    "is_main_replica",
    "load",
    "load_common_state",
    "read_metadata_json",
    "save",
    "sharded_tensors",
]
