"""``save`` and ``load`` of sharded state dicts (``torch_dist`` format), with Megatron-Core's signatures.

A sharded state dict is a nested dict (lists allowed) whose leaves are ``ShardedTensor``,
``ShardedObject``, ``ShardedTensorFactory``, ``LocalNonpersistentObject`` or plain values. Plain values
are *common*: rank 0 writes them once (see ``files``). ``load`` returns only what the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.metadata import (
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
)
from megatron.core.dist_checkpointing.sharded_io import read_sharded, write_sharded
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
from megatron.core.dist_checkpointing.strict import StrictHandling, parse_strict_flag

__all__ = [
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "save",
]


def _check_strategy(strategy: Any, classes: tuple[type, ...]) -> None:
    if strategy is None or isinstance(strategy, classes):
        return
    if isinstance(strategy, tuple) and strategy[:1] == ("torch_dist",):
        return
    raise ConfigError(
        f"sharded_strategy={strategy!r}: only the 'torch_dist' backend is implemented; pass None "
        "or a strategy from dist_checkpointing.strategies (e.g. get_default_save_sharded_strategy())"
    )


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
        raise ConfigError(
            "async_sharded_save=True: asynchronous checkpoint saving is not implemented; "
            "pass async_sharded_save=False (save returns once the checkpoint is complete)"
        )
    _check_strategy(sharded_strategy, (TorchDistSaveShardedStrategy, FullyParallelSaveStrategyWrapper))
    write_sharded(
        sharded_state_dict,
        checkpoint_dir,
        validate_access_integrity=validate_access_integrity,
        preprocess_common_before_consistancy_check=preprocess_common_before_consistancy_check,
        content_metadata=content_metadata,
        verify_integrity=verify_integrity,
        common_state=common_state,
        process_group=process_group,
    )


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
    return read_sharded(
        sharded_state_dict,
        checkpoint_dir,
        strict=mode,
        verify_integrity=verify_integrity,
        process_group=process_group,
    )


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every tensor of the checkpoint, whole and unsharded, by key (common values not included).
    Collective when distributed (each rank reads everything)."""
    request = load_tensors_metadata(checkpoint_dir)
    out = load(request, checkpoint_dir, validate_access_integrity=False)
    assert isinstance(out, dict)
    return {k: out[k] for k in request}
