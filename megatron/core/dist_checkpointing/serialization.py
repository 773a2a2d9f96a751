"""``save`` and ``load`` of sharded state dicts (``torch_dist`` format), with Megatron-Core's signatures.

A sharded state dict is a nested dict (lists allowed) whose leaves are ``ShardedTensor``,
``ShardedObject``, ``ShardedTensorFactory``, ``LocalNonpersistentObject`` or plain values. Plain values
are *common*: rank 0 writes them once (see ``files``). ``load`` returns only what the checkpoint holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from megatron.core.config_utils import ConfigError
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
    StateDict,
    is_main_replica,
)
from megatron.core.dist_checkpointing.metadata import (
    CONTENT_METADATA_KEY,
    checkpoint_keys,
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
)
from megatron.core.dist_checkpointing.state_tree import (
    build_result,
    expand_factories,
    iter_sharded,
    strip_sharded,
    unsaved_plain_paths,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
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

__all__ = [
    "get_default_load_sharded_strategy", "get_default_save_sharded_strategy", "load", "load_common_state_dict",
    "load_content_metadata", "load_plain_tensors", "load_sharded_metadata", "load_tensors_metadata", "save",
]


def _check_strategy(strategy: Any, classes: tuple[type, ...]) -> None:
    if strategy is None or isinstance(strategy, classes):
        return
    if isinstance(strategy, tuple) and strategy[:1] == ("torch_dist",):
        return
    raise ConfigError(f"sharded_strategy={strategy!r}: only the 'torch_dist' backend is implemented; pass None "
                      "or a strategy from dist_checkpointing.strategies (e.g. get_default_save_sharded_strategy())")


def _as_block(leaf: Any) -> Any:
    """A ShardedTensor whose ``data`` has the global number of axes (a view: prepended axes as size 1)."""
    if not isinstance(leaf, ShardedTensor) or leaf.prepend_axis_num == 0:
        return leaf
    assert leaf.data is not None
    shape = leaf.block_shape
    return replace(leaf, data=leaf.data.view(shape), local_shape=shape, prepend_axis_num=0,
                   axis_fragmentations=None)


def _warn_if_common_differs(common: dict, preprocess: Callable[[dict], dict] | None, process_group: Any) -> None:
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
            logger.warning("rank %d's common state differs from rank 0's (which is saved): only on rank 0 %s, "
                           "only here %s, different %s", dist.get_rank(), only0, only_here, [m[0] for m in mismatch])


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[dict], dict] | None = None,
    content_metadata: dict | None = None,
    async_strategy: str | None = "nvrx",
    verify_integrity: bool = False,
    *,
    common_state: dict | None = None,
    process_group: Any = None,
) -> None:
    """Collectively save a sharded state dict to ``checkpoint_dir`` (created if needed).

    Factories are saved as what they build and non-persistent objects left out (``sharded_state_dict``
    itself is not changed). Each rank writes the ShardedTensor blocks and ShardedObjects it holds as
    main replica; rank 0 writes the plain values, ``common_state`` and ``content_metadata`` (see
    ``load_content_metadata``). With ``validate_access_integrity`` all ranks first check together that
    every global tensor is covered exactly once by main replicas and every object has one (and warn
    where a rank's plain values differ from rank 0's, after ``preprocess_common_before_consistancy_check``);
    keys, global shapes and dtypes are always checked. ``verify_integrity`` also writes a SHA-256
    manifest. ``metadata.json`` is written last (an existing one removed first). Returns None: the
    checkpoint is complete when ``save`` returns.

    Raises:
        ConfigError: ``async_sharded_save=True`` (not implemented) or a strategy of another backend.
        CheckpointError: a sharding, shape or key problem (on every rank, before writing), or a key of
            ``common_state`` / ``content_metadata`` that also is a plain value.
        CheckpointWriteError: a file could not be written (on every rank when DCP's write failed on any).
    """
    if async_sharded_save:
        raise ConfigError("async_sharded_save=True: asynchronous checkpoint saving is not implemented; "
                          "pass async_sharded_save=False (save returns once the checkpoint is complete)")
    _check_strategy(sharded_strategy, (TorchDistSaveShardedStrategy, FullyParallelSaveStrategyWrapper))
    tree = expand_factories(sharded_state_dict)
    common = strip_sharded(tree)
    extra = dict(common_state or {})
    if content_metadata is not None:
        extra = {**extra, CONTENT_METADATA_KEY: content_metadata}
    for key, value in extra.items():
        if key in common:
            raise files.CheckpointError(f"common_state key {key!r} is also a key of the sharded state dict")
        common[key] = value
    leaves = [_as_block(leaf) for leaf in iter_sharded(tree)]
    errors = validate_save(leaves, reserved_keys={COMMON_STATE_KEY}, gather=lambda x: all_gather(x, process_group),
                           check_access=validate_access_integrity)
    files.raise_if_any(errors, process_group, f"cannot save checkpoint to {checkpoint_dir}:")
    if validate_access_integrity:
        _warn_if_common_differs(common, preprocess_common_before_consistancy_check, process_group)
    _write(leaves, common, checkpoint_dir, verify_integrity, process_group)


def _write(leaves: list, common: dict, checkpoint_dir: str, verify_integrity: bool, process_group: Any) -> None:
    tensors = [t for t in leaves if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
    objects = {o.unique_key: o.data for o in leaves if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)}
    rank0 = group_rank(process_group) == 0
    if rank0:
        objects[COMMON_STATE_KEY] = common
        files.make_dir(checkpoint_dir)
        for name in (METADATA_FILE, INTEGRITY_FNAME):  # overwriting: never look complete while half-written
            if os.path.isfile(os.path.join(checkpoint_dir, name)):
                os.remove(os.path.join(checkpoint_dir, name))
    files.barrier(process_group)
    files.make_dir(checkpoint_dir)
    dcp_save(tensors, objects, checkpoint_dir, process_group)
    files.barrier(process_group)
    if rank0 and verify_integrity:
        save_integrity_manifest(checkpoint_dir)
    if rank0:
        files.write_metadata_json(checkpoint_dir)
    files.barrier(process_group)


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: str | bool | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Any = None,
) -> Any:  # StateDict, or (StateDict, missing_keys, unexpected_keys) in the RETURN_* modes
    """Collectively load the slices each rank asks for; return them in the request's nesting.

    Each ShardedTensor's ``data`` is filled in place with its global block (read from whichever saved
    chunks overlap it, so the saving layout does not matter; ``data=None`` is allocated on the CPU) and
    appears in the result as that tensor; values are cast to its dtype, and with
    ``allow_shape_mismatch`` only the part inside the saved global shape is read. ShardedObjects
    become their saved value, factories their ``merge_fn`` of what they built, non-persistent objects
    their local value. The result holds every common value of the checkpoint and nothing that was
    not saved: a plain value of the request that the checkpoint lacks is left out (and is an
    unexpected key for ``strict``). ``strict`` (a ``StrictHandling``, its value string, or a bool: True
    is ``ASSUME_OK_UNEXPECTED``, False ``LOG_UNEXPECTED``) decides what a mismatch does; the
    ``RETURN_*`` modes return ``(state_dict, missing_keys, unexpected_keys)``. ``verify_integrity``
    first checks the files against the manifest ``save(verify_integrity=True)`` wrote.
    ``validate_access_integrity`` is accepted; any rank may read any slices, so it checks nothing.

    Raises:
        CheckpointError (a ``CheckpointingException`` and ``ValueError``): missing directory, incomplete
            checkpoint, an unexpected sharded key (default mode) or any mismatch (``RAISE_*``), a
            global shape that differs, on every rank, naming the directory and the keys.
        CheckpointReadError: a file this rank reads is missing, truncated or unreadable (named).
    """
    mode = parse_strict_flag(strict)
    _check_strategy(sharded_strategy, (TorchDistLoadShardedStrategy, FullyParallelLoadStrategyWrapper))
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
    missing = checkpoint_keys(dcp_md) - set().union(*(keys for _, keys in gathered)) if need_missing else set()
    errors = sorted({e for rank_errors, _ in gathered for e in rank_errors})
    errors += [e for e in mismatch_errors(mode, missing, set()) if e not in errors]
    if errors:
        raise files.errors_exception(errors, f"cannot load checkpoint {checkpoint_dir}:")  # the same on every rank
    report_mismatch(mode, checkpoint_dir, missing, unexpected)

    object_keys = sorted({o.unique_key for o in blocks if isinstance(o, ShardedObject) and id(o) not in req.skipped})
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


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every tensor of the checkpoint, whole and unsharded, by key (common values not included).
    Collective when distributed (each rank reads everything)."""
    request = load_tensors_metadata(checkpoint_dir)
    out = load(request, checkpoint_dir, validate_access_integrity=False)
    assert isinstance(out, dict)
    return {k: out[k] for k in request}
