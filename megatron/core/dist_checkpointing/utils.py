"""Splitting sharded state dicts by leaf type and renaming their sharded keys (Megatron-Core's
``dist_checkpointing.utils`` helpers that model code calls)."""

from __future__ import annotations

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

_Split = tuple[ShardedStateDict, StateDict]


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> _Split:
    """(the ShardedTensor leaves, every other leaf), both keeping the nesting."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))  # type: ignore[return-value]


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> _Split:
    """(the ShardedTensor and ShardedTensorFactory leaves, every other leaf)."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, ShardedTensor | ShardedTensorFactory)
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> _Split:
    """(the ShardedTensor, ShardedTensorFactory and LocalNonpersistentObject leaves, every other leaf)."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict,
        lambda v: isinstance(v, ShardedTensor | ShardedTensorFactory | LocalNonpersistentObject),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> _Split:
    """(the sharded leaves: tensors, objects, factories; every other leaf)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))  # type: ignore[return-value]


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> _Split:
    """(the LocalNonpersistentObject leaves, every other leaf)."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf, in place."""

    def add(x: object) -> object:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf, in place.

    Raises:
        ValueError: a key does not start with ``old_prefix`` (naming it).
    """

    def swap(x: object) -> object:
        if isinstance(x, ShardedTensor | ShardedTensorFactory | ShardedObject):
            if not x.key.startswith(old_prefix):
                raise ValueError(
                    f"replace_prefix_for_sharding: key {x.key!r} does not start with {old_prefix!r}"
                )
            x.key = new_prefix + x.key[len(old_prefix) :]
        return x

    dict_list_map_inplace(swap, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Rename sharded keys by the first ``old -> new`` prefix of ``prefix_map`` they start with, in
    place; keys matching none are kept."""

    def swap(x: object) -> object:
        if isinstance(x, ShardedTensor | ShardedTensorFactory | ShardedObject):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = new + x.key[len(old) :]
                    break
        return x

    dict_list_map_inplace(swap, sharded_state_dict)
