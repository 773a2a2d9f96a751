#!/usr/bin/env python3
"""Concatenate indexed datasets (``.bin/.idx`` pairs) into one.

    python tools/merge_datasets.py --input DIR_OR_PREFIX [...] --output-prefix merged

Each ``--input`` is a dataset prefix (``X`` for ``X.bin`` + ``X.idx``) or a directory, whose
top-level ``.bin/.idx`` pairs are merged in sorted order. Sub-directories are never read: training
keeps its index cache in ``<prefix>/cache/`` (or ``--data-cache-path``), so a prefix is often also
a directory, and it is taken as the prefix; ``X/`` (trailing slash) asks for the directory. Every
input is checked before anything is written: a lone ``.bin`` or ``.idx``, a dataset named twice,
mixed token dtypes or the output among the inputs stop the tool with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.config_utils import ConfigError  # noqa: E402
from megatron.core.datasets.errors import DataError  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402

SUFFIXES = (".bin", ".idx")


def _pair_or_raise(prefix: str, what: str) -> bool:
    """Whether ``prefix`` has both files; one without the other is a broken dataset."""
    have = [os.path.isfile(prefix + s) for s in SUFFIXES]
    if all(have):
        return True
    if any(have):
        lone, missing = (prefix + s for s in (SUFFIXES if have[0] else SUFFIXES[::-1]))
        raise DataError(f"{what}: {lone!r} has no {missing!r}; give both files of a dataset, or move it out")
    return False


def datasets_in(directory: str) -> list[str]:
    """The prefixes of the ``.bin/.idx`` pairs at the top level of ``directory`` (sorted)."""
    stems = sorted(
        {
            name[:-4]
            for name in os.listdir(directory)
            if name.endswith(SUFFIXES) and os.path.isfile(os.path.join(directory, name))
        }
    )
    found = [os.path.join(directory, s) for s in stems]
    for prefix in found:
        _pair_or_raise(prefix, f"--input directory {directory!r}")
    if not found:
        raise ConfigError(
            f"--input directory {directory!r} holds no .bin/.idx pairs at its top level "
            "(sub-directories, such as index caches, are not read)"
        )
    return found


def resolve(item: str) -> tuple[list[str], bool]:
    """The dataset prefixes one ``--input`` names, and whether it was read as a directory."""
    if item.endswith(SUFFIXES) and _pair_or_raise(item[:-4], f"--input {item!r}"):
        raise ConfigError(f"--input {item!r}: give the prefix {item[:-4]!r}, without .bin/.idx")
    if not item.endswith(os.sep) and _pair_or_raise(item, f"--input {item!r}"):
        return [item], False
    if os.path.isdir(item):
        return datasets_in(item), True
    raise ConfigError(
        f"--input {item!r} is neither a dataset prefix ({item}.bin + {item}.idx) nor a directory"
    )


def expand(inputs: list[str], output_prefix: str) -> list[str]:
    """Every dataset the inputs name, in order, each exactly once. The output is never an input:
    named as a prefix it is refused; found in a directory (an earlier merge) it is left out."""
    out = os.path.realpath(output_prefix)
    seen: dict[str, str] = {}
    prefixes: list[str] = []
    for item in inputs:
        found, is_directory = resolve(item)
        for prefix in found:
            real = os.path.realpath(prefix)
            if real == out and not is_directory:
                raise ConfigError(
                    f"--output-prefix {output_prefix!r} is also an --input; write to a new prefix"
                )
            if real == out:
                continue
            if real in seen:
                raise ConfigError(
                    f"--input names the dataset {prefix!r} twice (via {seen[real]!r} and {item!r}); "
                    "list each dataset once"
                )
            seen[real] = item
            prefixes.append(prefix)
    if not prefixes:
        raise ConfigError(f"--input {' '.join(inputs)!r} holds no dataset other than --output-prefix")
    return prefixes


def check_inputs(prefixes: list[str]) -> np.dtype:
    """Open every dataset, so that a truncated or corrupt one fails before anything is written;
    returns their token dtype, which must be one."""
    dtypes = {prefix: np.dtype(IndexedDataset(prefix).index.dtype) for prefix in prefixes}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p} ({d.name})" for p, d in dtypes.items())
        raise DataError(
            f"--input datasets store different token dtypes ({listing}); merge datasets "
            "preprocessed with one tokenizer"
        )
    return dtypes[prefixes[0]]


def merge(prefixes: list[str], output_prefix: str) -> None:
    directory = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(directory):
        raise ConfigError(f"--output-prefix {output_prefix!r}: directory {directory!r} does not exist")
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=check_inputs(prefixes))
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx")
    except BaseException:  # no half-written dataset is left behind, and an existing output stays as it was
        builder.abort()
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Merge Megatron .bin/.idx datasets.")
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="dataset prefixes and/or directories of datasets (top level only; DIR/ for a "
        "directory that is also a prefix)",
    )
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    args = p.parse_args(argv)
    try:
        prefixes = expand(args.input, args.output_prefix)
        merge(prefixes, args.output_prefix)
    except (ConfigError, DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    merged = IndexedDataset(args.output_prefix)
    for prefix in prefixes:
        print(f"  {prefix}")
    print(
        f"merged {len(prefixes)} datasets: {len(merged)} sequences, {len(merged.document_indices) - 1} "
        f"documents -> {args.output_prefix}.{{bin,idx}}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
