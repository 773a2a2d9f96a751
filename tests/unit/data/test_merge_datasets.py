"""tools/merge_datasets.py: which datasets an --input names, and one error line for each mistake."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_spec = importlib.util.spec_from_file_location(
    "merge_datasets", os.path.join(ROOT, "tools", "merge_datasets.py")
)
merge_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_tool)


def with_cache(prefix: str) -> str:
    """What a training run leaves: ``<prefix>/cache/GPTDataset_indices/*`` (the prefix is a directory)."""
    cache = os.path.join(prefix, "cache", "GPTDataset_indices")
    os.makedirs(cache)
    open(os.path.join(cache, "abc-GPTDataset-train-description.txt"), "w").close()
    return prefix


def merge(capsys, *inputs: str, out: str) -> tuple[int, str]:
    rc = merge_tool.main(["--input", *inputs, "--output-prefix", out])
    captured = capsys.readouterr()
    return rc, captured.err.strip()


def documents(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture
def two(tmp_path):
    """Datasets a and b in tmp_path/data, each also a directory holding an index cache."""
    os.makedirs(tmp_path / "data")
    return [
        with_cache(write_dataset(str(tmp_path / "data" / name), random_docs(seed, 5 + seed)))
        for seed, name in enumerate("ab")
    ]


def test_prefix_that_is_also_a_directory(tmp_path, capsys, two):
    rc, err = merge(capsys, two[1], two[0], out=str(tmp_path / "m"))
    assert rc == 0, err
    assert documents(str(tmp_path / "m")) == documents(two[1]) + documents(two[0])  # in --input order


def test_directory_merges_its_top_level_pairs_only(tmp_path, capsys, two):
    open(tmp_path / "data" / "vocab.json", "w").close()
    out = str(tmp_path / "data" / "merged")
    for _ in range(2):  # the second run finds the first one's output and leaves it out
        rc, err = merge(capsys, str(tmp_path / "data"), out=out)
        assert rc == 0, err
        assert documents(out) == documents(two[0]) + documents(two[1])
    rc, err = merge(capsys, two[0] + os.sep, out=str(tmp_path / "m"))  # DIR/ asks for the directory
    assert rc == 2 and err == (
        f"error: --input directory '{two[0]}{os.sep}' holds no .bin/.idx pairs at its top "
        "level (sub-directories, such as index caches, are not read)"
    )


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "lone_bin",
            "error: --input directory '{d}': '{d}/c.bin' has no '{d}/c.idx'; give both files of a dataset, "
            "or move it out",
        ),
        (
            "lone_idx",
            "error: --input directory '{d}': '{d}/c.idx' has no '{d}/c.bin'; give both files of a dataset, "
            "or move it out",
        ),
        (
            "twice",
            "error: --input names the dataset '{d}/a' twice (via '{d}' and '{d}/a'); list each dataset once",
        ),
        ("suffix", "error: --input '{d}/a.idx': give the prefix '{d}/a', without .bin/.idx"),
        (
            "missing",
            "error: --input '{d}/nope' is neither a dataset prefix ({d}/nope.bin + {d}/nope.idx) nor a "
            "directory",
        ),
        ("output_is_input", "error: --output-prefix '{d}/a' is also an --input; write to a new prefix"),
        (
            "dtypes",
            "error: --input datasets store different token dtypes ({d}/a (uint16), {d}/b (uint16), {d}/c "
            "(int32)); merge datasets preprocessed with one tokenizer",
        ),
    ],
)
def test_mistakes_stop_before_writing(tmp_path, capsys, two, case, message):
    d = str(tmp_path / "data")
    inputs, out = [d], str(tmp_path / "m")
    if case == "lone_bin":
        open(os.path.join(d, "c.bin"), "wb").close()
    elif case == "lone_idx":
        open(os.path.join(d, "c.idx"), "wb").close()
    elif case == "twice":
        inputs = [d, two[0]]
    elif case == "suffix":
        inputs = [two[0] + ".idx"]
    elif case == "missing":
        inputs = [os.path.join(d, "nope")]
    elif case == "output_is_input":
        inputs, out = [two[0], two[1]], two[0]
    elif case == "dtypes":
        write_dataset(os.path.join(d, "c"), random_docs(9, 3), vocab_size=100_000)
    before = documents(two[0])
    rc, err = merge(capsys, *inputs, out=out)
    assert (rc, err) == (2, message.format(d=d))
    assert documents(two[0]) == before
    if case != "output_is_input":
        assert not any(os.path.exists(out + s) for s in (".bin", ".idx"))


def test_corrupt_input_is_found_before_writing(tmp_path, capsys, two):
    with open(two[1] + ".bin", "r+b") as f:
        f.truncate(4)
    rc, err = merge(capsys, *two, out=str(tmp_path / "m"))
    assert rc == 2 and "is truncated" in err and two[1] in err
    assert not os.path.exists(str(tmp_path / "m.bin"))
    assert np.array_equal(IndexedDataset(two[0])[0], random_docs(0, 5)[0])
