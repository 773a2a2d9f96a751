"""Error types of dist_checkpointing: a caller's configuration mistake is a ConfigError naming the
parameter (``params``); a sharding or state problem is a CheckpointError."""

from __future__ import annotations

import pytest
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import CheckpointError, ShardedTensor
from megatron.core.dist_checkpointing.mapping import apply_factory_merges
from megatron.core.dist_checkpointing.metadata import load_content_metadata
from megatron.core.dist_checkpointing.strategies import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strict import parse_strict_flag


@pytest.mark.parametrize(
    "call, params",
    [
        (lambda: parse_strict_flag("bogus"), ("strict",)),
        (lambda: get_default_save_sharded_strategy(backend="zarr"), ("backend",)),
        (lambda: get_default_save_sharded_strategy(version=2), ("version",)),
        (
            lambda: ShardedTensor.from_rank_offsets("w", torch.zeros(2), flattened_range=slice(0, 1)),
            ("flattened_range",),
        ),
        (lambda: load_content_metadata(), ("checkpoint_dir", "preloaded_state_dict")),
    ],
)
def test_configuration_mistakes_are_config_errors_naming_the_parameter(call, params) -> None:
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.params == params
    assert all(p in str(e.value) for p in params)


def test_async_save_is_refused_as_a_config_error() -> None:
    with pytest.raises(ConfigError, match="async_save"):
        TorchDistSaveShardedStrategy().async_save({}, "unused")


def test_state_problems_are_checkpoint_errors() -> None:
    shard = ShardedTensor.from_rank_offsets("w", torch.zeros(3), (0, 1, 2))
    object.__setattr__(shard, "global_shape", (4,))  # the block [3, 6) lies outside [0, 4)
    with pytest.raises(CheckpointError, match="exceeds global size"):
        shard.validate()
    with pytest.raises(CheckpointError, match="lists of lengths"):
        apply_factory_merges([1], [1, 2])


def test_a_strategy_saves_and_loads_without_the_public_entry_points(tmp_path) -> None:
    saved = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    get_default_save_sharded_strategy().save(saved, tmp_path)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    loaded = get_default_load_sharded_strategy(tmp_path).load(request, tmp_path)
    torch.testing.assert_close(loaded["w"], torch.arange(4.0))


def test_saving_a_tensor_without_data_names_it(tmp_path) -> None:
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4)).without_data()}
    with pytest.raises(CheckpointError, match="ShardedTensor w has no data"):
        get_default_save_sharded_strategy().save(request, tmp_path)
