"""The ``torch_dist`` writer and reader of sharded state dicts, below ``serialization``'s public
``save`` / ``load`` (which check their Megatron-Core arguments) and the strategy classes'
``save`` / ``load`` (which call these directly).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from megatron.core.dist_checkpointing import files
from megatron.core.dist_checkpointing.dict_utils import diff
from megatron.core.dist_checkpointing.files import COMMON_STATE_KEY, METADATA_FILE, all_gather, group_rank
from megatron.core.dist_checkpointing.integrity import (
    INTEGRITY_FNAME,
    save_integrity_manifest,
    verify_integrity_manifest,
)
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.metadata import CONTENT_METADATA_KEY, checkpoint_keys
from megatron.core.dist_checkpointing.state_tree import (
    MISSING,
    build_result,
    expand_factories,
    iter_sharded,
    strip_sharded,
    unsaved_plain_paths,
)
from megatron.core.dist_checkpointing.strict import (
    StrictHandling,
    mismatch_errors,
    parse_strict_flag,
    report_mismatch,
)
from megatron.core.dist_checkpointing.torch_dist import dcp_load, dcp_save, read_dcp_metadata
from megatron.core.dist_checkpointing.validation import validate_load_request, validate_save

logger = logging.getLogger(__name__)


def _as_block(leaf: Any) -> Any:
    """A ShardedTensor whose ``data`` has the global number of axes (a view: prepended axes as size 1)."""
    if not isinstance(leaf, ShardedTensor) or leaf.prepend_axis_num == 0:
        return leaf
    assert leaf.data is not None
    shape = leaf.block_shape
    return replace(
        leaf, data=leaf.data.view(shape), local_shape=shape, prepend_axis_num=0, axis_fragmentations=None
    )


def _warn_if_common_differs(
    common: dict, preprocess: Callable[[dict], dict] | None, process_group: Any
) -> None:
    """Collective: log a warning on each rank whose common values differ from rank 0's (rank 0's are saved)."""
    if files.group_size(process_group) == 1:
        return
    mine = preprocess(common) if preprocess is not None else common
    box = [mine]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    if group_rank(process_group) != 0:
        only0, only_here, mismatch = diff(box[0], mine)
        if only0 or only_here or mismatch:
            logger.warning(
                "rank %d's common state differs from rank 0's (which is saved): only on rank 0 %s, "
                "only here %s, different %s",
                dist.get_rank(),
                only0,
                only_here,
                [m[0] for m in mismatch],
            )


def write_sharded(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    *,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[dict], dict] | None = None,
    content_metadata: dict | None = None,
    verify_integrity: bool = False,
    common_state: dict | None = None,
    process_group: Any = None,
) -> None:
    """``serialization.save`` once its arguments are checked (see there)."""
    tensors, objects = prepare_write(
        sharded_state_dict,
        checkpoint_dir,
        validate_access_integrity=validate_access_integrity,
        preprocess_common_before_consistancy_check=preprocess_common_before_consistancy_check,
        content_metadata=content_metadata,
        common_state=common_state,
        process_group=process_group,
    )
    dcp_save(tensors, objects, checkpoint_dir, process_group)
    files.barrier(process_group)
    rank0 = group_rank(process_group) == 0
    if rank0 and verify_integrity:
        save_integrity_manifest(checkpoint_dir)
    if rank0:
        files.write_metadata_json(checkpoint_dir)
    files.barrier(process_group)


def prepare_write(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    *,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[dict], dict] | None = None,
    content_metadata: dict | None = None,
    common_state: dict | None = None,
    process_group: Any = None,
) -> tuple[list[ShardedTensor], dict[str, Any]]:
    """Collective: everything a save does before DCP writes. Check the state dict on every rank, make
    ``checkpoint_dir`` (an existing ``metadata.json`` removed first: it never looks complete while being
    overwritten); return this rank's main-replica blocks and objects (rank 0's include the common values).

    Raises:
        CheckpointError: as ``serialization.save``, before anything is written.
        CheckpointWriteError: the directory cannot be created.
    """
    tree = expand_factories(sharded_state_dict)
    common = strip_sharded(tree)
    common = {} if common is MISSING else common
    extra = dict(common_state or {})
    if content_metadata is not None:
        extra = {**extra, CONTENT_METADATA_KEY: content_metadata}
    for key, value in extra.items():
        if key in common:
            raise files.CheckpointError(f"common_state key {key!r} is also a key of the sharded state dict")
        common[key] = value
    leaves = [_as_block(leaf) for leaf in iter_sharded(tree)]
    errors = validate_save(
        leaves,
        reserved_keys={COMMON_STATE_KEY},
        gather=lambda x: all_gather(x, process_group),
        check_access=validate_access_integrity,
    )
    files.raise_if_any(errors, process_group, f"cannot save checkpoint to {checkpoint_dir}:")
    if validate_access_integrity:
        _warn_if_common_differs(common, preprocess_common_before_consistancy_check, process_group)
    tensors = [t for t in leaves if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
    objects = {
        o.unique_key: o.data for o in leaves if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)
    }
    if group_rank(process_group) == 0:
        objects[COMMON_STATE_KEY] = common
        files.make_dir(checkpoint_dir)
        for name in (METADATA_FILE, INTEGRITY_FNAME):  # overwriting: never look complete while half-written
            if os.path.isfile(os.path.join(checkpoint_dir, name)):
                os.remove(os.path.join(checkpoint_dir, name))
    files.barrier(process_group)
    files.make_dir(checkpoint_dir)
    return tensors, objects


def read_sharded(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    *,
    strict: str | bool | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Any = None,
) -> Any:
    """``serialization.load`` once its arguments are checked (see there)."""
    mode = parse_strict_flag(strict)
    files.read_metadata_json(checkpoint_dir)
    if verify_integrity:
        verify_integrity_manifest(checkpoint_dir, process_group)
    tree = expand_factories(sharded_state_dict)
    common = files.load_common_state(checkpoint_dir)
    dcp_md = read_dcp_metadata(checkpoint_dir)
    originals = list(iter_sharded(tree))
    for leaf in originals:
        if isinstance(leaf, ShardedTensor):
            leaf.init_data("cpu")
    blocks = [_as_block(leaf) for leaf in originals]
    req = validate_load_request(blocks, dcp_md, strict=mode == StrictHandling.ASSUME_OK_UNEXPECTED)
    unexpected = {o.key for o, b in zip(originals, blocks) if id(b) in req.skipped}
    unexpected |= set(unsaved_plain_paths(tree, common))
    need_missing = StrictHandling.requires_global_app_metadata(mode)
    accessed = {o.key for o in originals} if need_missing else set()
    local_errors = req.errors + mismatch_errors(mode, set(), unexpected)
    gathered = all_gather((local_errors, accessed), process_group)
    missing = (
        checkpoint_keys(dcp_md) - set().union(*(keys for _, keys in gathered)) if need_missing else set()
    )
    errors = sorted({e for rank_errors, _ in gathered for e in rank_errors})
    errors += [e for e in mismatch_errors(mode, missing, set()) if e not in errors]
    if errors:
        raise files.errors_exception(
            errors, f"cannot load checkpoint {checkpoint_dir}:"
        )  # the same on every rank
    report_mismatch(mode, checkpoint_dir, missing, unexpected)

    object_keys = sorted(
        {o.unique_key for o in blocks if isinstance(o, ShardedObject) and id(o) not in req.skipped}
    )
    files.raise_file_problems(checkpoint_dir, dcp_md, {*object_keys, *req.blocks})
    objects = dcp_load(req.blocks, object_keys, checkpoint_dir, process_group)
    loaded: dict[int, Any] = {}
    for orig, block in zip(originals, blocks):
        if id(block) not in req.skipped:
            loaded[id(orig)] = orig.data if isinstance(orig, ShardedTensor) else objects[orig.unique_key]
    result = build_result(tree, common, loaded)
    if StrictHandling.requires_returning_mismatch_keys(mode):
        return result, missing, unexpected
    return result
