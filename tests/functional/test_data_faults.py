"""Issue 23, end to end ("nothing lost, nothing silent"): preprocessing into an existing prefix that is
killed or reads a corrupt input keeps the old pair; an empty input is an error; data that does not
fit the model's vocabulary, an index of another corpus and an odd blend stop the run with one line."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from launch import ROOT, torchrun

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training import checkpointing
from megatron.training.cli import run

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
MODEL = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --num-workers 0 --log-interval 1 --train-iters 2 "
    "--eval-iters 0"
).split()
ERROR = "pretrain_gpt.py: error: "


def preprocess(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def write_jsonl(path: str, n: int, words: int = 30, opener=open) -> None:
    """``n`` lines of ``words`` integers (NullTokenizer text), a cycle of 997 distinct lines."""
    cycle = [
        json.dumps({"text": " ".join(str((i + j) % 997) for j in range(words))}) + "\n" for i in range(997)
    ]
    with opener(path, "wt") as f:
        f.write("".join(cycle) * (n // len(cycle)) + "".join(cycle[: n % len(cycle)]))


def fingerprint(prefix: str) -> tuple[str, str]:
    return tuple(hashlib.md5(open(prefix + s, "rb").read()).hexdigest() for s in (".bin", ".idx"))  # type: ignore


@pytest.fixture
def old(tmp_path) -> tuple[str, str, tuple[str, str]]:
    """An existing dataset (output prefix, dataset prefix, md5 of its .bin and .idx)."""
    src = str(tmp_path / "old.jsonl")
    write_jsonl(src, 200)
    out = str(tmp_path / "corpus")
    rc, err = finish(preprocess("--input", src, "--output-prefix", out, *NULL, "--append-eod"))
    assert rc == 0, err
    prefix = out + "_text_document"
    return out, prefix, fingerprint(prefix)


def assert_intact(tmp_path, prefix: str, md5s: tuple[str, str]) -> None:
    """The old pair is byte for byte what it was, loads, passes its checksum record, and no
    temporary file of the interrupted write is mistaken for data."""
    assert fingerprint(prefix) == md5s
    from megatron.core.datasets.integrity import verify_dataset

    ds = IndexedDataset(prefix)
    assert len(ds) == 200 and ds[0].tolist()[-1] == 999
    verify_dataset(ds)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith((".bin", ".idx"))) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]


@pytest.mark.slow
def test_kill_9_during_preprocessing_keeps_the_old_pair(tmp_path, old):
    out, prefix, md5s = old
    big = str(tmp_path / "big.jsonl")
    write_jsonl(big, 150_000, words=40)  # ~17 MB: many 1 MB batches, seconds of work
    proc = preprocess(
        "--input",
        big,
        "--output-prefix",
        out,
        *NULL,
        "--append-eod",
        "--log-interval",
        "1",
        start_new_session=True,
    )
    try:
        line = proc.stderr.readline()  # the first batch has been written when its progress line comes
        assert line.startswith("Processed"), line
    finally:
        os.killpg(
            proc.pid, signal.SIGKILL
        )  # the tool and its tokenizer workers, as kill -9 or the OOM killer
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL  # killed mid-way, not finished
    assert_intact(tmp_path, prefix, md5s)


@pytest.mark.slow
def test_sigterm_during_preprocessing_removes_its_temporary_files(tmp_path, old):
    out, prefix, md5s = old
    big = str(tmp_path / "big.jsonl")
    write_jsonl(big, 150_000, words=40)
    proc = preprocess(
        "--input", big, "--output-prefix", out, *NULL, "--log-interval", "1", start_new_session=True
    )
    assert proc.stderr.readline().startswith("Processed")
    os.killpg(proc.pid, signal.SIGTERM)  # as a terminal, torchrun or Slurm sends it
    rc, err = finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == (
        "error: interrupted; nothing was written (a dataset already at --output-prefix is unchanged)"
    )
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]
    assert_intact(tmp_path, prefix, md5s)


@pytest.mark.slow
def test_ids_outside_the_vocabulary_are_skipped_when_preprocessing(tmp_path):
    """NullTokenizer text is the ids themselves: one beyond --vocab-size went into the .bin (and a
    negative one stopped the tool with a traceback)."""
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("1 2 3", "4 1000 5", "-3 6", "7 999")))
    out = str(tmp_path / "ids")
    rc, err = finish(preprocess("--input", str(src), "--output-prefix", out, *NULL, "--append-eod"))
    assert rc == 0, err
    assert err.strip().splitlines()[-1] == (
        "Skipped 2 lines (2 token id outside the vocabulary [0, 1000)); first: ids.jsonl:2: token id outside the "
        "vocabulary [0, 1000); ids.jsonl:3: token id outside the vocabulary [0, 1000)"
    )
    ds = IndexedDataset(out + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 999], [7, 999, 999]]


@pytest.mark.slow
def test_corrupt_gz_input_keeps_the_old_pair_and_names_the_file(tmp_path, old):
    out, prefix, md5s = old
    good = str(tmp_path / "new.jsonl.gz")
    write_jsonl(good, 20_000, opener=gzip.open)
    data = open(good, "rb").read()
    bad = str(tmp_path / "broken.jsonl.gz")
    with open(bad, "wb") as f:
        f.write(data[: len(data) // 2])  # a download cut short
    rc, err = finish(preprocess("--input", good, bad, "--output-prefix", out, *NULL, "--append-eod"))
    assert rc == 2
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"--input {bad!r} cannot be read" in errors[0], err
    assert "Traceback" not in err and "Done:" not in err
    assert_intact(tmp_path, prefix, md5s)


@pytest.mark.slow
def test_empty_input_is_an_error_and_writes_nothing(tmp_path, old):
    out, prefix, md5s = old
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, err = finish(preprocess("--input", str(empty), "--output-prefix", str(tmp_path / "fresh"), *NULL))
    assert rc == 2 and err.strip().splitlines() == [
        f"error: --input {str(empty)!r} holds no documents (0 lines); nothing was written"
    ]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fresh")]
    # Into an existing prefix: that one stays as it was (every line skipped counts as empty too).
    empty.write_text("not json\n\n")
    rc, err = finish(preprocess("--input", str(empty), "--output-prefix", out, *NULL))
    assert rc == 2 and err.strip().splitlines() == [
        f"error: --input {str(empty)!r} holds no documents (2 lines, all skipped: 1 empty line, 1 malformed JSON; "
        f"first: empty.jsonl:1: malformed JSON); nothing was written"
    ]
    assert_intact(tmp_path, prefix, md5s)


def documents(prefix: str, n: int = 60, bad: dict[int, int] | None = None) -> str:
    """``n`` documents of 40 tokens (ids < 127, EOD 127 last); ``bad`` puts id v at token 3 of
    every document i % k == 0 for k, v in it."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(n):
        doc = rng.integers(0, 127, size=40).astype(np.uint16)
        doc[-1] = 127
        for k, v in (bad or {}).items():
            if i % k == 0:
                doc[3] = v
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def train(capsys, prefix, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = run(MODEL + ["--data-path", prefix, "--split", "100,0,0", *extra])
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.slow
def test_out_of_vocabulary_ids_stop_the_run_before_training(tmp_path, capsys):
    """Ids at or beyond the vocabulary: past the model's 128 embedding rows (an IndexError at step
    1 before, or a device-side assert on a GPU), or inside its padding rows (trained silently)."""
    prefix = documents(str(tmp_path / "oov"), bad={4: 130})  # every 4th document holds id 130
    rc, err = train(capsys, prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")
    assert rc == 2 and err == [
        f"{ERROR}--data-path: {prefix + '.bin'!r} holds token id 130, outside the vocabulary of NullTokenizer "
        f"(--vocab-size 128: ids 0 to 127); it would index past the model's embedding of 128 rows. "
        f"Train with the tokenizer the data was made with, or preprocess the data again with this one"
    ]
    ok = documents(str(tmp_path / "ok"))  # ids 0 to 127, the end-of-document id 127 included
    rc, err = train(capsys, ok, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")  # padded to 128
    assert rc == 2 and len(err) == 1, err
    assert (
        f"{ok + '.bin'!r} holds token id 127, outside the vocabulary of NullTokenizer (--vocab-size 100: ids 0 "
        "to 99); it would train padding row 127 of the model's embedding of 128 rows" in err[0]
    )
    assert train(capsys, ok, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")[0] == 0


@pytest.mark.slow
def test_index_of_another_corpus_stops_the_run(tmp_path, capsys):
    small = documents(str(tmp_path / "small"), n=30)
    big = documents(str(tmp_path / "big"), n=60)
    os.replace(small + ".idx", big + ".idx")  # big.bin is now paired with the index of 30 documents
    rc, err = train(capsys, big, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"{ERROR}--data-path: data file {big + '.bin'!r} holds 4800 bytes, but its index "
        f"{big + '.idx'!r} ends its last document at byte 2400"
    ), err


@pytest.mark.slow
def test_two_ranks_stop_alike_on_a_pair_that_fails_its_record(tmp_path):
    """Rank 0 verifies (the cache is fresh) while rank 1 waits for its result: both exit 2, one line."""
    a = documents(str(tmp_path / "a"))
    b = documents(str(tmp_path / "b"), bad={3: 5})  # same sizes, other tokens
    os.replace(b + ".bin", a + ".bin")
    args = MODEL + [
        "--data-path",
        a,
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--global-batch-size",
        "4",
        "--data-cache-path",
        str(tmp_path / "cache"),
    ]
    res = torchrun(2, args, expect_ok=False, timeout=300)
    out = res.stdout + res.stderr
    assert (
        out.count(ERROR) == 1
        and f"{ERROR}--data-path: {a}.bin/.idx do not match their checksum record" in out
    )
    assert out.count("exitcode  : 2") == 2 and out.count("Traceback") == 1, out[-3000:]  # torchrun's own


@pytest.mark.slow
def test_odd_blend_names_the_weights_and_prefixes(tmp_path, capsys):
    prefix = documents(str(tmp_path / "a"))
    capsys.readouterr()
    rc = run(MODEL + ["--data-path", "0.5", prefix, "0.5", "--split", "100,0,0", *NULL])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and err == [
        f"{ERROR}--data-path '0.5 {prefix} 0.5': weights and prefixes must alternate (WEIGHT PREFIX "
        f"[WEIGHT PREFIX ...], e.g. 0.3 A 0.7 B) or be prefixes only; 3 entries cannot pair up"
    ]


def _at_iteration(monkeypatch, when: int, action) -> None:
    """Run ``action()`` once, when the loop has finished iteration ``when`` (mid-run, in this process)."""
    from megatron.training import training

    original = training.note_iteration

    def note(iteration: int) -> None:
        original(iteration)
        if iteration == when:
            action()

    monkeypatch.setattr(training, "note_iteration", note)


def _children() -> set[int]:
    pid = os.getpid()
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found.update(int(p) for p in f.read().split())
    return found


@pytest.mark.parametrize("fault", ["truncated", "worker killed"])
def test_a_data_fault_mid_run_saves_the_last_step_and_names_the_file_and_sample(
    tmp_path, capsys, monkeypatch, fault
):
    """A .bin truncated under the running job (its pages would SIGBUS), or a DataLoader worker killed
    (kill -9, as the OOM killer does): one line naming the file and the sample (or the worker and the
    step), exit 2, and a checkpoint of the last complete step that resumes."""
    prefix = documents(str(tmp_path / "d"), n=400)
    ck = tmp_path / "ck"
    if fault == "truncated":
        _at_iteration(monkeypatch, 3, lambda: os.truncate(prefix + ".bin", 64))
        workers = "0"
    else:  # this process's only children are the run's DataLoader workers
        _at_iteration(monkeypatch, 3, lambda: [os.kill(p, signal.SIGKILL) for p in _children()])
        workers = "1"
    args = [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--train-iters",
        "40",
        "--save",
        str(ck),
    ]
    rc, err = train(capsys, prefix, *args, "--save-interval", "100", "--num-workers", workers)
    assert rc == 2 and len(err) == 1, err
    saved = checkpointing.read_tracker(str(ck))
    assert saved is not None and saved >= 3
    assert err[0].endswith(f"; iteration {saved} was saved: resume from it with --load {ck}"), err[0]
    if fault == "truncated":
        assert err[0].startswith(f"{ERROR}data file {prefix + '.bin'!r} changed while training"), err[0]
        assert "(reading sample " in err[0] and f"loading a micro-batch of iteration {saved + 1}" in err[0]
    else:
        assert "a DataLoader worker died while loading a micro-batch of iteration" in err[0], err[0]
        assert "exited unexpectedly" in err[0] or "killed by signal" in err[0], err[0]
    monkeypatch.undo()
    documents(prefix, n=400)  # the file restored
    rc, err = train(capsys, prefix, *args, "--load", str(ck), "--exit-interval", str(saved + 2))
    assert rc == 0 and not err, err
