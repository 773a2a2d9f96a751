"""Walking a sharded state dict: its sharded leaves, its plain (common) part, and the result of a load.

A ``ShardedTensorFactory`` is expanded once into a ``Built`` node (the factory and the sub-state-dict
it built), so that the sub-state-dict's leaves are what is saved or loaded, and a load can hand the
loaded sub-state-dict back to the factory's ``merge_fn``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

MISSING = object()  # a leaf absent from a result
Leaf = ShardedTensor | ShardedObject


@dataclass
class Built:
    """A factory and the sub-state-dict its ``build`` returned."""

    factory: ShardedTensorFactory
    sub: Any


def expand_factories(tree: Any) -> Any:
    """A copy of the containers of ``tree`` with every factory replaced by its ``Built`` node (leaves shared)."""
    return dict_list_map_outplace(
        lambda x: Built(x, x.build()) if isinstance(x, ShardedTensorFactory) else x, tree
    )


def _children(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return list(tree.values())
    if isinstance(tree, list):
        return tree
    if isinstance(tree, Built):
        return [tree.sub]
    return []


def iter_sharded(tree: Any) -> Iterator[Leaf]:
    """Every ShardedTensor / ShardedObject leaf of a nested dict/list, in a deterministic order."""
    if isinstance(tree, ShardedTensor | ShardedObject):
        yield tree
        return
    for child in _children(tree):
        yield from iter_sharded(child)


def strip_sharded(tree: Any) -> Any:
    """The plain (common) part of a tree: sharded and non-persistent leaves dropped (``None``
    placeholders in lists that also hold plain values), and so are dicts and lists that held nothing
    else; factories replaced by the plain part of what they built. ``MISSING`` when nothing is plain."""
    if isinstance(tree, Built):
        return strip_sharded(tree.sub)
    if isinstance(tree, dict):
        out = {k: strip_sharded(v) for k, v in tree.items()}
        kept = {k: v for k, v in out.items() if v is not MISSING}
        # A dict of sharded leaves only leaves nothing behind either: ranks holding different blocks
        # (a flat-sharded optimizer state) then have the same common part.
        return MISSING if out and not kept else kept
    if isinstance(tree, list):
        items = [strip_sharded(v) for v in tree]
        if items and all(v is MISSING for v in items):
            return MISSING  # a list of sharded leaves only leaves nothing behind
        return [None if v is MISSING else v for v in items]
    if isinstance(tree, ShardedTensor | ShardedObject | LocalNonpersistentObject):
        return MISSING
    return tree


def _has_plain(tree: Any) -> bool:
    if isinstance(tree, dict | list | Built):
        return any(_has_plain(c) for c in _children(tree))
    return not isinstance(tree, ShardedTensor | ShardedObject | LocalNonpersistentObject)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def unsaved_plain_paths(request: Any, common: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the request's plain values that the checkpoint's common part does not hold."""
    if isinstance(request, Built):
        return unsaved_plain_paths(request.sub, common, prefix)
    if isinstance(request, dict):
        if not isinstance(common, dict):
            return [prefix] if prefix and _has_plain(request) else []
        return [
            p
            for k, v in request.items()
            for p in unsaved_plain_paths(v, common.get(k, MISSING), _join(prefix, k))
        ]
    if isinstance(request, list):
        if not (isinstance(common, list) and len(common) == len(request)):
            return [prefix] if _has_plain(request) else []
        return [
            p
            for i, (v, c) in enumerate(zip(request, common))
            for p in unsaved_plain_paths(v, c, _join(prefix, i))
        ]
    if isinstance(request, ShardedTensor | ShardedObject | LocalNonpersistentObject):
        return []
    return [prefix] if common is MISSING else []


def build_result(request: Any, common: Any, loaded: dict[int, Any]) -> Any:
    """The request's nesting with sharded leaves replaced by ``loaded[id(leaf)]`` (absent: left out),
    plain leaves by the checkpoint's (absent: left out; ``None`` in a list), non-persistent objects
    by their local value and factories by their ``merge_fn``; every other common value of the
    checkpoint added."""
    if isinstance(request, Built):
        return request.factory.merge_fn(build_result(request.sub, common, loaded))
    if isinstance(request, dict):
        out = dict(common) if isinstance(common, dict) else {}
        for key, value in request.items():
            sub = common.get(key, MISSING) if isinstance(common, dict) else MISSING
            built = build_result(value, sub, loaded)
            if built is MISSING:
                out.pop(key, None)
            else:
                out[key] = built
        return out if out or isinstance(common, dict) else MISSING
    if isinstance(request, list) and request:
        subs = (
            common if isinstance(common, list) and len(common) == len(request) else [MISSING] * len(request)
        )
        items = [build_result(v, s, loaded) for v, s in zip(request, subs)]
        if all(v is MISSING for v in items):
            return MISSING
        return [None if v is MISSING else v for v in items]
    if isinstance(request, ShardedTensor | ShardedObject):
        return loaded.get(id(request), MISSING)
    if isinstance(request, LocalNonpersistentObject):
        return request.unwrap()
    return common
