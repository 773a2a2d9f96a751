"""Helpers over nested dicts and lists (state dicts); any other value (tuples included) is a leaf."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def extract_matching_values(
    x: dict | list, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[dict | list, dict | list]:
    """Split ``x`` into (leaves where ``predicate`` holds, the other leaves), both keeping the nesting.

    A sub-container is kept on a side only if it has leaves there (an empty one stays on the
    non-matching side). With ``return_lists_as_dicts`` lists become dicts keyed by the index, so that
    the original positions can be restored.

    Raises:
        ValueError: ``x`` is neither a dict nor a list.
    """
    if isinstance(x, dict):
        items: Iterable[tuple[Any, Any]] = x.items()
    elif isinstance(x, list):
        items = enumerate(x)
    else:
        raise ValueError(f"extract_matching_values: x must be a dict or a list, got {type(x).__name__}")
    as_dict = isinstance(x, dict) or return_lists_as_dicts
    match: dict | list = {} if as_dict else []
    rest: dict | list = {} if as_dict else []

    def put(target: dict | list, k: Any, v: Any) -> None:
        if isinstance(target, dict):
            target[k] = v
        else:
            target.append(v)

    for k, v in items:
        if isinstance(v, dict | list) and v:
            sub_match, sub_rest = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_match:
                put(match, k, sub_match)
            if sub_rest:
                put(rest, k, sub_rest)
        elif isinstance(v, dict | list):
            put(rest, k, v)
        else:
            put(match if predicate(v) else rest, k, v)
    return match, rest


def _values_differ(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        try:
            return a.shape != b.shape or not bool(torch.equal(a.cpu(), b.cpu()))
        except (RuntimeError, TypeError):
            return True
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):
        return True


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Compare two nested values: ``(only_left, only_right, mismatch)``.

    ``only_left`` / ``only_right`` hold the key paths (tuples) present on one side only; ``mismatch``
    holds ``(path, type(left), type(right))`` for leaves present on both sides that differ (tensors:
    all elements compared). Sharded leaves (having ``replica_id``) are compared by their ``data``.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        mismatch: list = []
        for k in x1.keys() & x2.keys():
            sub = diff(x1[k], x2[k], prefix + (k,))
            left, right, mismatch = left + sub[0], right + sub[1], mismatch + sub[2]
        return left, right, mismatch
    if isinstance(x1, list | tuple) and type(x1) is type(x2):
        left = [prefix + (i,) for i in range(len(x2), len(x1))]
        right = [prefix + (i,) for i in range(len(x1), len(x2))]
        mismatch = []
        for i, (a, b) in enumerate(zip(x1, x2)):
            sub = diff(a, b, prefix + (i,))
            left, right, mismatch = left + sub[0], right + sub[1], mismatch + sub[2]
        return left, right, mismatch
    if hasattr(x1, "replica_id") and hasattr(x2, "replica_id") and type(x1) is type(x2):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    return [], [], ([(prefix, type(x1), type(x2))] if _values_differ(x1, x2) else [])


def nested_values(x: dict | list) -> Iterator[Any]:
    """Every leaf of a nested dict/list, depth first in insertion order."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, dict | list):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: dict | list) -> Iterator[tuple[dict | list, Any, Any]]:
    """``(container, key or index, leaf)`` for every leaf of a nested dict/list."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, dict | list):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: dict) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: dict) -> None:
    """Replace every leaf ``v`` (at key or index ``k`` of its container) by ``f(k, v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``f`` to every leaf of ``x``, replacing the leaves of its dicts and lists in place; return ``x``
    (``f(x)`` when ``x`` itself is a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """A new nested dict/list with ``f`` applied to every leaf of ``x``; ``x`` is not changed."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: dict | list, x2: dict | list, key: tuple = ()) -> dict | list:
    """Merge ``x2`` into ``x1`` in place (recursively) and return ``x1``.

    Keys only in ``x2`` are added; lists merge element-wise.

    Raises:
        ValueError: lists of different lengths, or a leaf present on both sides (naming the key path).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"merge: lists of lengths {len(x1)} and {len(x2)} at key path {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
        return x1
    raise ValueError(f"merge: both sides hold a value at key path {key}: {x1!r} and {x2!r}")


def map_reduce(
    xs: Iterable,
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[list], Any] = lambda x: x,
) -> dict:
    """Group ``value_fn(x)`` by ``key_fn(x)`` and reduce each group with ``reduce_fn`` (as
    ``more_itertools.map_reduce``)."""
    groups: dict[Any, list] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
