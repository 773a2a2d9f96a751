"""Split and blend parsing, and the on-disk index cache shared by every dataset class."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.errors import DataError

# Megatron-Core's datasets.utils has it.
from megatron.core.logging_utils import log_single_rank as log_single_rank


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def normalize(weights: Sequence[float]) -> list[float]:
    """Scale non-negative weights to sum to 1."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ConfigError(
            f"blend weights must be non-negative and not all zero, got {list(weights)}", params=("blend",)
        )
    return (w / w.sum()).tolist()


def parse_and_normalize_split(split: str) -> list[float]:
    """``"969,30,1"`` (any separators) -> ``[0.969, 0.030, 0.001]``; missing entries are 0."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(values) <= 3:
        raise ConfigError(f"split {split!r} must hold 1 to 3 numbers, e.g. '969,30,1'", params=("split",))
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise ConfigError(f"split {split!r} must have a positive total", params=("split",))
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: Sequence[float], vector_b: Sequence[float] | None = None
) -> list[tuple[float, float] | None]:
    """Proportions -> book-ends ``[(0, a0), (a0, a0+a1), (a0+a1, 1)]``; an empty range becomes None.

    With ``vector_b`` (a second split) the book-ends are intersected (Megatron's multi-split use).
    """

    def bookends(v: Sequence[float]) -> list[tuple[float, float]]:
        edges = np.concatenate([[0.0], np.cumsum(v)])
        return [(float(edges[i]), float(edges[i + 1])) for i in range(len(v))]

    a = bookends(vector_a)
    b = bookends(vector_b) if vector_b is not None else a
    out: list[tuple[float, float] | None] = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        out.append(None if hi <= lo or a0 == a1 else (lo, hi))
    return out


def get_blend_from_list(
    blend: Sequence[str] | None, flag: str = "--data-path"
) -> tuple[list[str], list[float] | None] | None:
    """``["0.3", "a", "0.7", "b"]`` -> ``(["a", "b"], [0.3, 0.7])``; ``["a", "b"]`` -> ``(["a", "b"], None)``.

    A single string holding spaces is split first. An odd-length list or a non-numeric first entry
    means prefixes only (Megatron's rule).

    Raises:
        ConfigError: read as prefixes only, the list holds a number that names no dataset (no
            ``.idx`` file): weights and prefixes that do not alternate, e.g. ``0.5 A 0.5``.
    """
    if blend is None:
        return None
    items = [x for s in blend for x in str(s).split()]
    if not items:
        return None
    if len(items) % 2 == 0:
        try:
            return items[1::2], [float(x) for x in items[0::2]]
        except ValueError:
            pass
    _check_prefixes_only(items, flag)
    return items, None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_prefixes_only(items: list[str], flag: str) -> None:
    """A weight among prefixes is a blend that lost an entry; a dataset named like a number is not."""
    if not any(_is_number(x) and not os.path.isfile(x + ".idx") for x in items):
        return
    if len(items) % 2:
        why = f"{len(items)} entries cannot pair up"
    else:
        bad = next(x for x in items[0::2] if not _is_number(x))
        why = f"{bad!r} stands where a weight should be"
    raise ConfigError(
        f"{flag} {' '.join(items)!r}: weights and prefixes must alternate (WEIGHT PREFIX "
        f"[WEIGHT PREFIX ...], e.g. 0.3 A 0.7 B) or be prefixes only; {why}"
    )


# ----------------------------------------------------------------------------------------------
# On-disk cache: files "{base}-{suffix}" written atomically; description.txt last.


def cache_paths(path_to_cache: str, base: str, suffixes: Sequence[str]) -> dict[str, str]:
    return {s: os.path.join(path_to_cache, f"{base}-{s}") for s in suffixes}


def cache_complete(paths: dict[str, str]) -> bool:
    return all(os.path.isfile(p) for p in paths.values())


def save_cache(paths: dict[str, str], description: str, arrays: dict[str, np.ndarray]) -> None:
    """Write every ``.npy`` (tmp + rename), then ``description.txt`` as the completion marker."""
    os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
    for suffix, arr in arrays.items():
        tmp = paths[suffix] + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, paths[suffix])
    tmp = paths["description.txt"] + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(description)
    os.replace(tmp, paths["description.txt"])


def load_cache(paths: dict[str, str], description: str) -> dict[str, np.ndarray]:
    """Memory-map the cached arrays; a description mismatch (hash collision, edit) raises."""
    with open(paths["description.txt"], encoding="utf-8") as f:
        if f.read() != description:
            raise DataError(f"cache file {paths['description.txt']!r} does not match this dataset; delete it")
    out = {}
    for suffix, path in paths.items():
        if suffix.endswith(".npy"):
            try:
                out[suffix] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                raise DataError(f"cache file {path!r} is corrupt ({exc}); delete it to rebuild") from None
    return out


def error_marker(paths: dict[str, str]) -> str:
    return paths["description.txt"].replace("description.txt", "error.txt")


def wait_for_cache(
    paths: dict[str, str],
    timeout_s: float,
    log: Callable[[str], object] = print,
    poll_s: float = 1.0,
    report_every_s: float = 30.0,
) -> None:
    """Poll until the builder rank has written every cache file (no collective, so no timeout
    of the process group can fire while one rank spends minutes building indices).

    Raises:
        RuntimeError: the builder rank reported a failure, or ``timeout_s`` passed.
    """
    start = last = time.monotonic()
    marker = error_marker(paths)
    while not cache_complete(paths):
        if os.path.isfile(marker):
            with open(marker, encoding="utf-8") as f:
                raise RuntimeError(f"the rank building {paths['description.txt']!r} failed: {f.read()}")
        now = time.monotonic()
        if now - start > timeout_s:
            raise RuntimeError(
                f"timed out after {timeout_s:.0f} s waiting for {paths['description.txt']!r}; "
                "is rank 0 building the index cache? (tools/prepare_cache.py builds it ahead)"
            )
        if now - last >= report_every_s:
            log(
                f" > waiting for rank 0 to build {os.path.basename(paths['description.txt'])} "
                f"({now - start:.0f} s so far)"
            )
            last = now
        time.sleep(poll_s)


def global_rank() -> int:
    """This process's rank, 0 without torch.distributed."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_or_wait(
    paths: dict[str, str],
    description: str,
    suffixes: Sequence[str],
    build: Callable[[], tuple],
    timeout_s: float,
    log: Callable[[str], object] = print,
) -> tuple | None:
    """The cache protocol for an incomplete cache. Global rank 0 builds the arrays, saves them under
    ``suffixes[1:]`` and returns them (on failure it leaves an error marker so waiting ranks stop
    too); every other rank waits for the files and returns None, then loads them."""
    if global_rank() != 0:
        wait_for_cache(paths, timeout_s, log)
        return None
    try:
        arrays = build()
        save_cache(paths, description, dict(zip(suffixes[1:], arrays)))
    except Exception as exc:
        os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
        with open(error_marker(paths), "w", encoding="utf-8") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    return arrays


def dumps_description(identifiers: dict) -> str:
    return json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)


def compile_helpers() -> None:
    """Megatron-Core's step that compiles its C++ index helpers. Ours are numpy
    (``megatron.core.datasets.helpers``): there is nothing to build, so this returns at once."""


# ----------------------------------------------------------------------------------------------
# One JSON result per key (small derived facts, e.g. a dataset's token-id range), same protocol.


def _read_json_result(path: str, key: dict) -> dict | None:
    """The cached result for ``key``, or None (absent, unreadable, or written for another key)."""
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("key") != key or not isinstance(cached.get("result"), dict):
        return None
    return cached["result"]


# The user's errors that a waiting rank raises as the builder rank did, by type name.
_REPORTED: dict[str, type[DataError] | type[ConfigError]] = {
    "DataError": DataError,
    "ConfigError": ConfigError,
}


def _raise_reported(marker: str) -> None:
    """Raise the failure the builder rank left in ``marker``: a ``DataError``, ``ConfigError`` or
    ``ValueError`` as one (with its ``params``), so that every rank reports the same message;
    anything else as a RuntimeError."""
    try:
        with open(marker, encoding="utf-8") as f:
            failure = json.load(f)
        kind, message = str(failure["type"]), str(failure["message"])
        params = tuple(failure.get("params", ()))
    except (OSError, ValueError, KeyError, TypeError):
        return  # half written: look again on the next poll
    if kind in _REPORTED:
        raise _REPORTED[kind](message, params=params)
    if kind == "ValueError":
        raise ValueError(message)
    raise RuntimeError(f"the rank computing {marker[: -len('.error')]!r} failed: {kind}: {message}")


def build_or_wait_json(
    path: str,
    key: dict,
    build: Callable[[], dict],
    timeout_s: float,
    log: Callable[[str], object] = print,
    poll_s: float = 0.5,
    report_every_s: float = 30.0,
) -> dict:
    """``build()``'s result for ``key``, cached in the JSON file ``path``. A cached file is used
    when it holds ``key``; otherwise global rank 0 builds and writes it (tmp + rename) and the other
    ranks poll for it. A failure of rank 0 goes into ``path + ".error"``, which the others raise.

    Raises:
        DataError, ConfigError, ValueError: ``build`` raised one (on every rank); DataError:
            ``path`` cannot be written.
        RuntimeError: rank 0 failed otherwise, or ``timeout_s`` passed.
    """
    found = _read_json_result(path, key)
    if found is not None:
        return found
    marker = path + ".error"
    if global_rank() != 0:
        start = last = time.monotonic()
        while (found := _read_json_result(path, key)) is None:
            if os.path.isfile(marker):
                _raise_reported(marker)
            now = time.monotonic()
            if now - start > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for rank 0 to write {path!r}")
            if now - last >= report_every_s:
                log(f" > waiting for rank 0 to write {os.path.basename(path)} ({now - start:.0f} s so far)")
                last = now
            time.sleep(poll_s)
        return found
    if os.path.isfile(marker):
        try:
            os.remove(marker)  # a failure of an earlier run
        except OSError:
            pass
    try:
        result = build()
    except Exception as exc:
        _report_failure(marker, type(exc).__name__, str(exc), getattr(exc, "params", ()))
        raise
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "result": result}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        message = f"cannot write {path!r} ({exc.strerror or exc}); give a writable path_to_cache"
        _report_failure(marker, "DataError", message, ("path_to_cache",))
        raise DataError(message, params=("path_to_cache",)) from None
    return result


def _report_failure(marker: str, kind: str, message: str, params: Sequence[str] = ()) -> None:
    failure: dict[str, Any] = {"type": kind, "message": message}
    if params:
        failure["params"] = list(params)
    try:
        os.makedirs(os.path.dirname(marker) or ".", exist_ok=True)
        tmp = f"{marker}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(failure, f)
        os.replace(tmp, marker)
    except OSError:  # an unwritable cache directory: the waiting ranks time out instead
        pass
