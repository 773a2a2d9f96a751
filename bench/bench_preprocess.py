#!/usr/bin/env python3
"""CPU benchmark: tools/preprocess_data.py against the plain single-process loop.

    python bench/bench_preprocess.py [--size-mb 200] [--workdir /tmp/bench_pre]

Corpus: documents of about 1,500 characters cut from the Python sources, reStructuredText,
Markdown and text files installed on the machine (natural text and code documentation), written
as JSONL. Tokenizer: a byte-level BPE of 32,000 tokens trained on the first 20 MB (HF
``tokenizers``), used as GPT2BPETokenizer with ``--append-eod``. Each configuration runs in a
fresh process; wall time, input MB/s and the peak RSS of the largest process are reported, and
the outputs are checked to be byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

PLAIN_LOOP = r"""
import json, os, sys, numpy as np
src, vocab, merges, prefix = sys.argv[1:5]
sys.path.insert(0, sys.argv[5])
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
tok = GPT2BPETokenizer(vocab, merges)
b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
def flush(texts):
    ids = [x + [tok.eod] for x in tok.tokenize_batch(texts)]
    b.add_documents(np.concatenate([np.asarray(x, np.uint16) for x in ids]), [len(x) for x in ids])
batch = []
for line in open(src, encoding="utf-8"):
    batch.append(json.loads(line)["text"])
    if len(batch) == 1000:
        flush(batch); batch = []
if batch:
    flush(batch)
b.finalize(prefix + ".idx")
"""


def build_corpus(path: str, size_mb: float) -> None:
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "/usr/share/doc"]
    budget, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as out:
        for root in roots:
            for d, dirs, files in os.walk(root):
                dirs.sort()
                for name in sorted(files):
                    if not name.endswith((".py", ".rst", ".md", ".txt")):
                        continue
                    try:
                        with open(os.path.join(d, name), encoding="utf-8") as f:
                            text = f.read()
                    except (UnicodeDecodeError, OSError):
                        continue
                    for i in range(0, len(text), 1500):
                        chunk = text[i : i + 1500]
                        line = json.dumps({"text": chunk}, ensure_ascii=False) + "\n"
                        out.write(line)
                        written += len(line.encode("utf-8"))
                        docs += 1
                        if written >= budget:
                            print(f"corpus: {docs} documents, {written / 1e6:.1f} MB -> {path}")
                            return
    print(f"corpus: {docs} documents, {written / 1e6:.1f} MB (all files found) -> {path}")


def train_bpe(corpus: str, out_dir: str) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    def texts(limit=20_000_000):
        seen = 0
        for line in open(corpus, encoding="utf-8"):
            seen += len(line)
            if seen > limit:
                return
            yield json.loads(line)["text"]

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts(), vocab_size=32000, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(out_dir)
    return os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")


MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run ``cmd`` under a fresh wrapper process: (wall seconds, peak RSS MiB of its largest process)."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *cmd],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return time.perf_counter() - start, int(out.stdout.strip()) / 1024


def md5(path: str) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=float, default=200)
    p.add_argument("--workdir", default="/tmp/bench_pre")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, "corpus.jsonl")
    if not os.path.isfile(corpus):
        build_corpus(corpus, args.size_mb)
    vocab, merges = train_bpe(corpus, args.workdir)
    mb = os.path.getsize(corpus) / 1e6
    tool = [
        sys.executable,
        os.path.join(ROOT, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--append-eod",
    ]
    runs = [
        (
            "plain loop, 2 tokenizer threads",
            [
                sys.executable,
                "-c",
                PLAIN_LOOP,
                corpus,
                vocab,
                merges,
                os.path.join(args.workdir, "plain2"),
                ROOT,
            ],
            {"RAYON_NUM_THREADS": "2"},
            "plain2",
        ),
        (
            "plain loop, 1 tokenizer thread",
            [
                sys.executable,
                "-c",
                PLAIN_LOOP,
                corpus,
                vocab,
                merges,
                os.path.join(args.workdir, "plain1"),
                ROOT,
            ],
            {"RAYON_NUM_THREADS": "1"},
            "plain1",
        ),
        (
            "preprocess_data.py --workers 1",
            tool + ["--workers", "1", "--output-prefix", os.path.join(args.workdir, "w1")],
            None,
            "w1_text_document",
        ),
        (
            "preprocess_data.py --workers 2",
            tool + ["--workers", "2", "--output-prefix", os.path.join(args.workdir, "w2")],
            None,
            "w2_text_document",
        ),
    ]
    sums = set()
    print(f"| tool | wall s | MB/s of input ({mb:.1f} MB) | peak RSS of the largest process |")
    print("|---|---|---|---|")
    for label, cmd, env, out in runs:
        wall, peak = timed(cmd, env)
        prefix = os.path.join(args.workdir, out)
        sums.add((md5(prefix + ".bin"), md5(prefix + ".idx")))
        print(f"| {label} | {wall:.1f} | {mb / wall:.2f} | {peak:.0f} MiB |", flush=True)
    print(f"outputs byte-identical: {len(sums) == 1}")


if __name__ == "__main__":
    main()
