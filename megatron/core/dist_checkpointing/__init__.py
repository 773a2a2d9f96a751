"""Distributed checkpointing: sharded state dicts saved and loaded (and resharded) with PyTorch DCP.

    sd = model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sd, checkpoint_dir=d)
    model.load_state_dict(dist_checkpointing.load(sharded_state_dict=sd, checkpoint_dir=d))

Megatron-Core 0.19's public names live at its paths: ``core``, ``dict_utils``, ``mapping``,
``serialization``, ``validation`` (``StrictHandling``) and ``strategies``.
"""

from megatron.core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint
from megatron.core.dist_checkpointing.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from megatron.core.dist_checkpointing.files import (
    METADATA_FILE,
    all_finite,
    check_files,
    is_complete_checkpoint,
    load_common_state,
    read_metadata_json,
    sharded_tensors,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from megatron.core.dist_checkpointing.serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from megatron.core.dist_checkpointing.strict import StrictHandling

__all__ = [
    "METADATA_FILE",
    "CheckpointError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "all_finite",
    "check_files",
    "check_is_distributed_checkpoint",
    "is_complete_checkpoint",
    "is_main_replica",
    "load",
    "load_common_state",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "read_metadata_json",
    "save",
    "sharded_tensors",
]
