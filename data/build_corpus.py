#!/usr/bin/env python3
"""Rebuild ``data/python_docs.jsonl.gz`` from the documentation shipped with CPython.

Documents: every topic of ``pydoc_data.topics`` (the language reference text ``help()`` shows),
then, per standard-library module, its module, class and function docstrings of at least 200
characters joined into one document. Output is deterministic for a given Python version
(sorted walk, gzip mtime 0). See data/README.md for the licence.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import sys
import sysconfig

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"}


def module_documents(stdlib: str) -> list[dict[str, str]]:
    docs = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            parts = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 200:
                        parts.append(doc)
            if parts:
                rel = os.path.relpath(path, stdlib)
                docs.append({"id": f"stdlib/{rel}", "text": "\n\n".join(parts)})
    return docs


def main(out: str) -> None:
    import pydoc_data.topics as topics

    docs = [{"id": f"topic/{k}", "text": topics.topics[k]} for k in sorted(topics.topics)]
    docs += module_documents(sysconfig.get_paths()["stdlib"])
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {len(docs)} documents to {out} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "python_docs.jsonl.gz"))
