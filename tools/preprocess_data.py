#!/usr/bin/env python3
"""Tokenize JSONL corpora into Megatron ``.bin/.idx`` files (byte-compatible with Megatron-LM).

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix out/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes ``out/corpus_text_document.{bin,idx}`` (one file pair per ``--json-keys`` entry).

Input is streamed in ~1 MB batches; at most ``2 * workers`` batches are in flight, so memory is
bounded whatever the input size. Malformed JSON, a missing key, a non-string value or non-UTF-8
bytes skip that line (for every key, so the outputs stay aligned), are counted, and the first few
are reported with their file and line number. A user error prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.core.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

BATCH_BYTES = 1 << 20
MAX_EXAMPLES = 5


class UserError(Exception):
    """Raised for bad flags or inputs: printed as one line, exit status 2."""


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl or .jsonl.gz), globs allowed")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--split-sentences", action="store_true", help="not supported (needs NLTK); rejected")
    g.add_argument("--keep-newlines", action="store_true", help="accepted for compatibility")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None)
    g.add_argument("--tiktoken-pattern", default="v2", choices=("v1", "v2"))
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--append-eod", action="store_true", help="append the eod id to every non-empty document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--partitions", type=int, default=1,
                   help="accepted for compatibility; input files are already streamed in parallel")
    g.add_argument("--log-interval", type=int, default=1000, help="report every this many documents")
    g.add_argument("--max-documents", type=int, default=None, help="stop after this many input lines")
    args = p.parse_args(argv)
    if args.split_sentences:
        raise UserError("--split-sentences is not supported (it needs NLTK punkt); pre-split text into a "
                        "list of strings per document instead")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise UserError(f"--log-interval must be >= 1, got {args.log_interval}")
    files: list[str] = []
    for pattern in args.input:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"--input {pattern!r} matches no file")
        for m in matches:
            if not os.path.isfile(m):
                raise UserError(f"--input {m!r} does not exist or is not a file")
        files.extend(matches)
    args.input_files = files
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise UserError(f"--output-prefix: directory {out_dir!r} does not exist")
    return args


def tokenizer_options(args: argparse.Namespace) -> dict[str, Any]:
    names = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
             "null_tokenizer_eod_id", "tiktoken_pattern", "tiktoken_num_special_tokens")
    return {n: getattr(args, n) for n in names}


# --------------------------------------------------------------------------------- workers
_STATE: dict[str, Any] = {}


def _init_worker(options: dict[str, Any], keys: list[str], append_eod: bool, threads: int) -> None:
    # Set before the tokenizer libraries start their thread pools (fresh spawned interpreter).
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    tok = build_tokenizer(argparse.Namespace(**options))
    _STATE.update(tokenizer=tok, keys=keys, append_eod=append_eod,
                  dtype=DType.optimal_dtype(tok.vocab_size))


def _parse_line(raw: bytes, keys: list[str]) -> tuple[list[list[str]] | None, str | None]:
    """The texts of each key of one JSON line (a list per key), or an error kind."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid UTF-8"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None, "malformed JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    out = []
    for k in keys:
        if k not in obj:
            return None, f"missing key {k!r}"
        v = obj[k]
        if isinstance(v, str):
            out.append([v])
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            out.append(v)
        else:
            return None, f"key {k!r} is not a string or list of strings"
    return out, None


def encode_batch(batch: tuple[str, int, list[bytes]]) -> dict[str, Any]:
    """Tokenize one batch of raw lines; returns per key the flat tokens, sequence lengths and
    sequences per document, plus the skipped lines."""
    name, first_line, lines = batch
    tok, keys, append_eod, dtype = _STATE["tokenizer"], _STATE["keys"], _STATE["append_eod"], _STATE["dtype"]
    parsed, errors = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            errors.append((f"{name}:{first_line + i}", "empty line"))
            continue
        texts, err = _parse_line(raw, keys)
        if err:
            errors.append((f"{name}:{first_line + i}", err))
        else:
            parsed.append(texts)
    out: dict[str, Any] = {"errors": errors, "docs": len(parsed), "bytes": sum(len(x) for x in lines)}
    eod = (tok.eod,)
    for k_i, key in enumerate(keys):
        sentences = [s for doc in parsed for s in doc[k_i]]
        ids = tok.tokenize_batch(sentences) if sentences else []
        lengths: list[int] = []
        per_doc: list[int] = []
        pieces: list[Any] = []
        pos = 0
        for doc in parsed:
            n = len(doc[k_i])
            kept = [x for x in ids[pos:pos + n] if len(x) > 0]  # empty sentences are dropped
            pos += n
            pieces.extend(kept)
            lengths.extend(len(x) for x in kept)
            if kept and append_eod:
                pieces.append(eod)
                lengths[-1] += 1
            per_doc.append(len(kept))
        flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=dtype, count=int(sum(lengths)))
        out[key] = (flat, np.asarray(lengths, np.int32), np.asarray(per_doc, np.int64))
    return out


# --------------------------------------------------------------------------------- main loop
def read_batches(files: list[str], max_documents: int | None) -> Iterator[tuple[str, int, list[bytes]]]:
    """Stream ``(file name, first line number, raw lines)`` batches of about BATCH_BYTES."""
    seen = 0
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        name = os.path.basename(path)
        try:
            with opener(path, "rb") as raw_f:
                f = io.BufferedReader(raw_f, 1 << 20) if path.endswith(".gz") else raw_f
                lines: list[bytes] = []
                size, first = 0, 1
                for line_no, line in enumerate(f, start=1):
                    if max_documents is not None and seen >= max_documents:
                        break
                    seen += 1
                    lines.append(line)
                    size += len(line)
                    if size >= BATCH_BYTES:
                        yield name, first, lines
                        lines, size, first = [], 0, line_no + 1
                if lines:
                    yield name, first, lines
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise UserError(f"--input {path!r} cannot be read: {exc}") from None


class Progress:
    """``--log-interval`` lines on stderr, and a tqdm bar when stderr is a terminal."""

    def __init__(self, interval: int, total_bytes: int) -> None:
        self.interval, self.start, self.docs, self.bytes, self.next = interval, time.perf_counter(), 0, 0, interval
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess")
            except ImportError:
                pass

    def update(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.docs >= self.next:
            self.next = (self.docs // self.interval + 1) * self.interval
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        return f"Processed {self.docs} documents ({self.docs / dt:.1f} docs/s, {self.bytes / dt / 1e6:.2f} MB/s)."

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Preprocess; returns counts (documents, skipped lines by kind, examples, seconds)."""
    options = tokenizer_options(args)
    probe = build_tokenizer(argparse.Namespace(**options))  # fail fast on a bad tokenizer flag
    dtype = DType.optimal_dtype(probe.vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in prefixes.items()}
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(args.workers, _init_worker, (options, args.json_keys, args.append_eod, threads))
    progress = Progress(args.log_interval, sum(os.path.getsize(f) for f in args.input_files))
    kinds: Counter[str] = Counter()
    examples: list[str] = []
    in_flight: deque = deque()
    start = time.perf_counter()

    def consume(result: dict[str, Any]) -> None:
        for where, kind in result["errors"]:
            kinds[kind] += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"{where}: {kind}")
        for k in args.json_keys:
            builders[k].add_documents(*result[k])
        progress.update(result["docs"], result["bytes"])

    try:
        for batch in read_batches(args.input_files, args.max_documents):
            in_flight.append(pool.apply_async(encode_batch, (batch,)))
            while len(in_flight) >= 2 * args.workers:
                consume(in_flight.popleft().get())
        while in_flight:
            consume(in_flight.popleft().get())
    finally:
        pool.terminate()
        progress.close()
    for k, builder in builders.items():
        builder.finalize(prefixes[k] + ".idx")
    return {"documents": progress.docs, "bytes": progress.bytes, "skipped": dict(kinds),
            "examples": examples, "seconds": time.perf_counter() - start, "prefixes": prefixes}


def main(argv: list[str] | None = None) -> int:
    try:
        args = get_args(argv)
        stats = run(args)
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mb_s = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e6
    print(f"Done: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.1f} s "
          f"({mb_s:.2f} MB/s) -> {', '.join(p + '.{bin,idx}' for p in stats['prefixes'].values())}",
          file=sys.stderr)
    skipped = sum(stats["skipped"].values())
    if skipped:
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(stats["skipped"].items()))
        print(f"Skipped {skipped} lines ({detail}); first: {'; '.join(stats['examples'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
