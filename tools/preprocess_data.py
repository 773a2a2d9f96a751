#!/usr/bin/env python3
"""Tokenize JSONL corpora into Megatron ``.bin/.idx`` files (byte-compatible with Megatron-LM).

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix out/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes ``out/corpus_text_document.{bin,idx}`` (one file pair per ``--json-keys`` entry). Run as a
script or through ``runpy.run_path(path, run_name="__main__")`` (a success returns normally, a failure
exits non-zero); ``get_args()``, ``main()`` and ``Encoder`` are Megatron-LM's names for its parts.

Input is streamed in ~1 MB batches; at most ``2 * workers`` batches are in flight, so memory is
bounded whatever the input size. Malformed JSON, a missing key, a non-string value or non-UTF-8
bytes skip that line (for every key, so the outputs stay aligned), are counted, and the first few
are reported with their file and line number. A user error (an input without any document
included) prints one line and exits 2.

Nothing at the output prefix changes until every input has been read: each pair is written under
temporary names and renamed into place at the end, with its checksum record
(``megatron.core.datasets.integrity``). A corrupt input, an error, Ctrl-C or SIGTERM (acted on at
the next batch boundary; a second one quits at once) leaves an existing dataset as it was; so does
a kill -9, which also leaves ``*.tmp.<pid>`` files to delete.
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
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.config_utils import ConfigError  # noqa: E402
from megatron.core.datasets.errors import DataError  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.core.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.training.param_flags import parser_flags, rewrite_params  # noqa: E402

BATCH_BYTES = 1 << 20
MAX_EXAMPLES = 5


class UserError(Exception):
    """Raised for bad flags or inputs: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags (Megatron-LM's spellings)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input")
    g.add_argument(
        "--input", nargs="+", required=True, help="JSONL files (.jsonl or .jsonl.gz), globs allowed"
    )
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
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted for compatibility; input files are already streamed in parallel",
    )
    g.add_argument("--log-interval", type=int, default=1000, help="report every this many documents")
    g.add_argument("--max-documents", type=int, default=None, help="stop after this many input lines")
    return p


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.split_sentences:
        raise UserError(
            "--split-sentences is not supported (it needs NLTK punkt); pre-split text into a "
            "list of strings per document instead"
        )
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise UserError(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.max_documents is not None and args.max_documents < 1:
        raise UserError(f"--max-documents must be >= 1, got {args.max_documents}")
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


_TOKENIZER_DEFAULTS: dict[str, Any] = {
    "vocab_file": None,
    "merge_file": None,
    "tokenizer_model": None,
    "vocab_size": None,
    "null_tokenizer_eod_id": None,
    "tiktoken_pattern": "v2",
    "tiktoken_num_special_tokens": 1000,
}


def tokenizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The tokenizer flags of ``args`` (a Megatron-LM namespace may lack some: their defaults)."""
    return {
        "tokenizer_type": args.tokenizer_type,
        **{n: getattr(args, n, default) for n, default in _TOKENIZER_DEFAULTS.items()},
    }


# --------------------------------------------------------------------------------- workers
_STATE: dict[str, Any] = {}


def _init_worker(options: dict[str, Any], keys: list[str], append_eod: bool, threads: int) -> None:
    # A signal to the process group (Ctrl-C, SIGTERM) is the main process's to handle: a worker that
    # died of it while waiting for a batch would hold the pool's queue lock forever.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Set before the tokenizer libraries start their thread pools (fresh spawned interpreter).
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _load_state(options, keys, append_eod)


def _load_state(options: dict[str, Any], keys: list[str], append_eod: bool) -> Any:
    """Build the tokenizer a worker (or ``Encoder``) tokenizes with; returns it."""
    tok = build_tokenizer(argparse.Namespace(**options))
    _STATE.update(tokenizer=tok, keys=keys, append_eod=append_eod, dtype=DType.optimal_dtype(tok.vocab_size))
    return tok


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


def _tokenize_documents(tok: Any, parsed: list[list[list[str]]], k_i: int) -> list[list[Any]]:
    """Per document, the ids of each non-empty sentence of key ``k_i`` (empty sentences are dropped)."""
    sentences = [s for doc in parsed for s in doc[k_i]]
    ids = tok.tokenize_batch(sentences) if sentences else []
    out, pos = [], 0
    for doc in parsed:
        n = len(doc[k_i])
        out.append([x for x in ids[pos : pos + n] if len(x) > 0])
        pos += n
    return out


def _assemble(docs: list[list[Any]], eod: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat int64 tokens, sequence lengths, sequences per document); ``eod`` ends each non-empty document."""
    lengths: list[int] = []
    per_doc: list[int] = []
    pieces: list[Any] = []
    for kept in docs:
        pieces.extend(kept)
        lengths.extend(len(x) for x in kept)
        if kept and eod is not None:
            pieces.append((eod,))
            lengths[-1] += 1
        per_doc.append(len(kept))
    flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(sum(lengths)))
    return flat, np.asarray(lengths, np.int32), np.asarray(per_doc, np.int64)


def _outside(docs: list[list[Any]], vocab_size: int) -> set[int]:
    """Documents holding an id outside [0, vocab_size) (only NullTokenizer input can: its text is the ids)."""
    return {i for i, kept in enumerate(docs) if any(min(x) < 0 or max(x) >= vocab_size for x in kept)}


def encode_batch(batch: tuple[str, int, list[bytes]]) -> dict[str, Any]:
    """Tokenize one batch of raw lines; returns per key the flat tokens, sequence lengths and
    sequences per document, plus the skipped lines (in line order)."""
    name, first_line, lines = batch
    tok, keys, append_eod, dtype = _STATE["tokenizer"], _STATE["keys"], _STATE["append_eod"], _STATE["dtype"]
    parsed, line_of, errors = [], [], []
    for i, raw in enumerate(lines):
        texts, err = _parse_line(raw, keys) if raw.strip() else (None, "empty line")
        if err:
            errors.append((i, err))
        else:
            parsed.append(texts)
            line_of.append(i)
    eod = tok.eod if append_eod else None
    docs = {key: _tokenize_documents(tok, parsed, k_i) for k_i, key in enumerate(keys)}
    assembled = {key: _assemble(docs[key], eod) for key in keys}
    if any(len(a[0]) and (a[0].min() < 0 or a[0].max() >= tok.vocab_size) for a in assembled.values()):
        bad = set().union(*(_outside(docs[key], tok.vocab_size) for key in keys))  # skipped for every key
        errors += [(line_of[i], f"token id outside the vocabulary [0, {tok.vocab_size})") for i in bad]
        errors.sort()
        docs = {key: [d for i, d in enumerate(docs[key]) if i not in bad] for key in keys}
        assembled = {key: _assemble(docs[key], eod) for key in keys}
        parsed = [d for i, d in enumerate(parsed) if i not in bad]
    out: dict[str, Any] = {
        "errors": [(f"{name}:{first_line + i}", kind) for i, kind in errors],
        "docs": len(parsed),
        "bytes": sum(len(x) for x in lines),
    }
    for key, (flat, lengths, per_doc) in assembled.items():
        out[key] = (flat.astype(dtype), lengths, per_doc)
    return out


class Encoder:
    """Megatron-LM's per-document encoder, over the same tokenization as the worker pool.

    ``Encoder(args).initializer()`` builds the tokenizer (``Encoder.tokenizer``); ``encode(json_line)``
    returns ``(ids, lens, len(json_line))`` where, per ``args.json_keys`` key, ``ids[key]`` is the
    document's token ids (every non-empty sentence's, then the eod id with ``args.append_eod`` unless
    the document is empty) and ``lens[key]`` the sentence lengths (the eod counted in the last one):
    the document ``main`` writes for that line. ``split(json_line)`` returns ``(json, len(json_line))``
    with each key's text as a list of pieces (no sentence splitting: ``--split-sentences`` is refused).
    """

    tokenizer: Any = None
    _PIECE_CHARS = 1_000_000

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = _load_state(
            tokenizer_options(self.args),
            list(self.args.json_keys),
            bool(getattr(self.args, "append_eod", False)),
        )

    def split(self, json_line: str) -> tuple[str, int]:
        data = json.loads(json_line)
        out = {}
        for key in self.args.json_keys:
            text = data[key]
            out[key] = (
                list(text)
                if isinstance(text, list)
                else [text[i : i + self._PIECE_CHARS] for i in range(0, len(text), self._PIECE_CHARS)]
            )
        return json.dumps(out), len(json_line)

    def encode(self, json_line: str | bytes) -> tuple[dict[str, list[int]], dict[str, list[int]], int]:
        """Raises ValueError for a line the tool would skip (malformed JSON, a missing key, ...)."""
        if Encoder.tokenizer is None:
            self.initializer()
        raw = json_line.encode("utf-8") if isinstance(json_line, str) else json_line
        texts, err = _parse_line(raw, list(self.args.json_keys))
        if err:
            raise ValueError(f"cannot encode this line: {err}")
        eod = Encoder.tokenizer.eod if getattr(self.args, "append_eod", False) else None
        ids, lens = {}, {}
        for k_i, key in enumerate(self.args.json_keys):
            flat, lengths, _ = _assemble(_tokenize_documents(Encoder.tokenizer, [texts], k_i), eod)
            ids[key], lens[key] = flat.tolist(), lengths.tolist()
        return ids, lens, len(json_line)


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
        self.interval, self.start, self.docs, self.bytes, self.next = (
            interval,
            time.perf_counter(),
            0,
            0,
            interval,
        )
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


def tokenize_into(
    args: argparse.Namespace, options: dict[str, Any], builders: dict[str, IndexedDatasetBuilder]
) -> dict[str, Any]:
    """Stream every input through the tokenizer pool into ``builders``; returns the counts."""
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(args.workers, _init_worker, (options, args.json_keys, args.append_eod, threads))
    progress = Progress(args.log_interval, sum(os.path.getsize(f) for f in args.input_files))
    kinds: Counter[str] = Counter()
    examples: list[str] = []
    in_flight: deque = deque()

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
            check_stop()
            in_flight.append(pool.apply_async(encode_batch, (batch,)))
            while len(in_flight) >= 2 * args.workers:
                consume(in_flight.popleft().get())
                check_stop()
        while in_flight:
            consume(in_flight.popleft().get())
            check_stop()
    finally:
        # The batches in flight (at most 2 x workers) finish; the workers, immune to signals, then
        # exit. terminate() is never used: it SIGTERMs workers that ignore it.
        pool.close()
        pool.join()
        progress.close()
    return {"documents": progress.docs, "bytes": progress.bytes, "skipped": dict(kinds), "examples": examples}


def no_documents(files: list[str], stats: dict[str, Any]) -> str:
    """The error for an input that yields no document (nothing is written then)."""
    named = ", ".join(repr(f) for f in files[:MAX_EXAMPLES]) + (
        f" and {len(files) - MAX_EXAMPLES} more" if len(files) > MAX_EXAMPLES else ""
    )
    skipped = sum(stats["skipped"].values())
    if not skipped:
        why = "0 lines"
    else:
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(stats["skipped"].items()))
        why = f"{skipped} lines, all skipped: {detail}; first: {stats['examples'][0]}"
    return (
        f"--input {named} {'holds' if len(files) == 1 else 'hold'} no documents ({why}); nothing was written"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Preprocess; returns counts (documents, skipped lines by kind, examples, seconds).

    The outputs appear only when every input has been read: each pair is written under temporary
    names and all pairs are renamed into place at the end (``IndexedDatasetBuilder``), so a failed
    or killed run leaves an existing dataset at the prefix as it was."""
    options = tokenizer_options(args)
    probe = build_tokenizer(argparse.Namespace(**options))  # fail fast on a bad tokenizer flag
    dtype = DType.optimal_dtype(probe.vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    start = time.perf_counter()
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        for k, p in prefixes.items():
            builders[k] = IndexedDatasetBuilder(p + ".bin", dtype=dtype)
        stats = tokenize_into(args, options, builders)
        if stats["documents"] == 0:
            raise UserError(no_documents(args.input_files, stats))
        for k, builder in builders.items():
            builder.prepare(prefixes[k] + ".idx")
        commit_all(list(builders.values()))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return {**stats, "seconds": time.perf_counter() - start, "prefixes": prefixes}


def commit_all(builders: list[IndexedDatasetBuilder]) -> None:
    """Rename every prepared pair into place, the per-key outputs together. A Ctrl-C or SIGTERM
    that comes now is only noted (``check_stop`` is not called again), so the run ends normally;
    only a kill -9 can land between two renames."""
    for builder in builders:
        builder.commit()


class Interrupted(BaseException):
    """Raised by ``check_stop`` after a Ctrl-C or SIGTERM: unwinds so that temporary files go."""


_SIGNALS: list[int] = []  # received, in order; set by the handler, acted on between batches


def _on_signal(signum: int, frame: Any) -> None:
    """Note the first signal: the main loop stops at the next batch boundary, where no pool lock is
    held (an exception raised inside the pool's own code could leave it waiting forever). A second
    one ends the process at once, as kill -9 would."""
    if _SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    _SIGNALS.append(signum)


def check_stop() -> None:
    if _SIGNALS:
        raise Interrupted(_SIGNALS[0])


def main(argv: list[str] | None = None) -> int:
    try:
        args = get_args(argv)
        stats = run(args)
    except (
        UserError,
        ConfigError,
        DataError,
    ) as exc:  # the library's names its parameters: write them as flags
        print(
            f"error: {rewrite_params(str(exc), getattr(exc, 'params', ()), parser_flags(build_parser()))}",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:  # e.g. an output directory that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        print(
            "error: interrupted; nothing was written (a dataset already at --output-prefix is unchanged)",
            file=sys.stderr,
        )
        return 128 + int(exc.args[0] if isinstance(exc, Interrupted) else signal.SIGINT)
    mb_s = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e6
    print(
        f"Done: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.1f} s "
        f"({mb_s:.2f} MB/s) -> {', '.join(p + '.{bin,idx}' for p in stats['prefixes'].values())}",
        file=sys.stderr,
    )
    skipped = sum(stats["skipped"].values())
    if skipped:
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(stats["skipped"].items()))
        print(f"Skipped {skipped} lines ({detail}); first: {'; '.join(stats['examples'])}", file=sys.stderr)
    return 0


def _run_as_script() -> None:
    """``main()`` with the stop signals handled between batches; the caller's handlers come back after
    (under ``runpy`` the caller is another program). Exits only on failure."""
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    _run_as_script()
