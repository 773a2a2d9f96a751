"""A user error in a job of several ranks: one ``pretrain_gpt.py: error:`` line for the whole job,
every rank exits 2, no traceback from any rank; a bug keeps its traceback.

torchrun itself cannot be made quiet: once a rank exits non-zero it SIGTERMs the others and exits 1
with its own ``ChildFailedError`` traceback and a table of the ranks' exit codes. The ranks' output
is therefore captured apart from torchrun's (test_signals.py's wrapper writes it per rank).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from test_signals import torchrun_ranks

from megatron.training.cli import run

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 1 --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--train-iters 2"
).split()
ERROR = "pretrain_gpt.py: error: "


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A checkpoint of the TINY model, an indexed corpus, its index cache and a corrupt copy of it."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    d = tmp_path_factory.mktemp("errors")
    prefix = str(d / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(20, 60))
        builder.add_document(rng.integers(0, 127, size=n).astype(np.uint16), [n])
    builder.finalize(prefix + ".idx")
    data = f"--data-path {prefix} --split 100,0,0 --tokenizer-type NullTokenizer".split()
    assert run(TINY + data + f"--save {d}/ck --data-cache-path {d}/cache".split()) == 0
    shutil.copytree(d / "cache", d / "bad_cache")
    for name in os.listdir(d / "bad_cache"):
        if name.endswith(".npy"):
            (d / "bad_cache" / name).write_bytes(b"not an array")
    return {"dir": d, "data": data}


def _job(tmp_path, args: list[str], per_rank: dict[int, str] | None = None) -> tuple[list[str], str]:
    """Two ranks under torchrun: (the ranks' outputs, torchrun's own), after checking that every
    rank exited 2 and torchrun 1."""
    from test_signals import rank_codes

    proc = torchrun_ranks(2, args, str(tmp_path), log=True, per_rank=per_rank)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    ranks = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert rank_codes(str(tmp_path), 2) == [2, 2], (ranks, out[-3000:])
    assert proc.returncode == 1, out[-3000:]
    return ranks, out


def _check_one_line(ranks: list[str], torchrun: str, expected: str) -> None:
    job = "".join([*ranks, torchrun])
    assert job.count(ERROR) == 1 and expected in job.split(ERROR)[1], ranks  # the message may go on below
    for text in ranks:
        assert "Traceback" not in text and "Connection" not in text, text[-3000:]
    # torchrun's own report: its one traceback, ChildFailedError, and exit code 2 for the ranks.
    assert torchrun.count("Traceback") == 1 and "ChildFailedError" in torchrun, torchrun[-3000:]
    assert "exitcode  : 2" in torchrun and "Connection" not in torchrun, torchrun[-3000:]


@pytest.mark.slow
def test_error_on_every_rank_after_init(tmp_path, made):
    """Both ranks find that the checkpoint holds another --hidden-size."""
    ranks, out = _job(tmp_path, TINY + f"--mock-data --load {made['dir']}/ck --hidden-size 64".split())
    _check_one_line(ranks, out, "--hidden-size: checkpoint 32 vs current 64")


@pytest.mark.slow
def test_error_on_the_data_building_rank_only(tmp_path, made):
    """With tp 2 only tp rank 0 builds datasets and reads the (corrupt) index cache; rank 1 is
    waiting in a collective with it meanwhile."""
    args = (
        TINY
        + made["data"]
        + f"--tensor-model-parallel-size 2 --data-cache-path {made['dir']}/bad_cache".split()
    )
    ranks, out = _job(tmp_path, args)
    _check_one_line(ranks, out, "is corrupt")
    assert ERROR in ranks[0]


@pytest.mark.slow
def test_error_on_a_nonzero_rank_only(tmp_path, made):
    """Data parallel: rank 1 alone reads a corrupt cache (as a node-local path might be); rank 0,
    which reads a good one, learns of the error from the store and leaves with code 2 as well."""
    per_rank = {0: f"--data-cache-path {made['dir']}/cache", 1: f"--data-cache-path {made['dir']}/bad_cache"}
    ranks, out = _job(tmp_path, TINY + made["data"], per_rank=per_rank)
    _check_one_line(ranks, out, "is corrupt")
    assert ERROR in ranks[1]


@pytest.mark.slow
def test_error_before_the_process_groups_exist(tmp_path):
    """Every rank raises the same flag error; they meet in torchrun's store, so that none is
    SIGTERMed by torchrun before it has exited 2 itself."""
    ranks, out = _job(tmp_path, TINY + "--mock-data --global-batch-size 3".split())
    _check_one_line(ranks, out, "--global-batch-size 3 is not divisible")


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Anything but a user error propagates out of the entry point (and so prints its traceback)."""
    from megatron.training import training

    def broken(cfg, providers):
        raise RuntimeError("a bug")

    monkeypatch.setattr(training, "pretrain", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        run(TINY + ["--mock-data"])
