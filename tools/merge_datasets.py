#!/usr/bin/env python3
"""Concatenate indexed datasets (``.bin/.idx`` pairs) into one.

    python tools/merge_datasets.py --input DIR_OR_PREFIX [...] --output-prefix merged

``--input`` takes prefixes and/or directories (every ``*.idx`` with a matching ``.bin`` in a
directory is merged, in sorted order). All inputs must share one token dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def expand(inputs: list[str], output_prefix: str) -> list[str]:
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            found = [p for p in found if os.path.isfile(p + ".bin") and os.path.abspath(p) != os.path.abspath(output_prefix)]
            if not found:
                raise ValueError(f"--input directory {item!r} holds no .bin/.idx pairs")
            prefixes.extend(found)
        elif IndexedDataset.exists(item):
            prefixes.append(item)
        else:
            raise ValueError(f"--input {item!r} is neither a directory nor a prefix with .bin and .idx files")
    return prefixes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Merge Megatron .bin/.idx datasets.")
    p.add_argument("--input", nargs="+", required=True, help="directories and/or dataset prefixes")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    args = p.parse_args(argv)
    try:
        prefixes = expand(args.input, args.output_prefix)
        first = IndexedDataset(prefixes[0])
        builder = IndexedDatasetBuilder(args.output_prefix + ".bin", dtype=first.index.dtype)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(args.output_prefix + ".idx")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    merged = IndexedDataset(args.output_prefix)
    print(f"merged {len(prefixes)} datasets: {len(merged)} sequences, {len(merged.document_indices) - 1} "
          f"documents -> {args.output_prefix}.{{bin,idx}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
