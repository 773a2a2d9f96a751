"""The argument parser and dispatch of ``tools/checkpoint.py``.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (``args -> exit code``) as its default. A user error (a missing directory, a damaged or
foreign checkpoint, a bad option) is one line ``checkpoint.py: error: ...`` and exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import CheckpointError
from megatron.training.checkpoint_tool import convert_cmd, diff_cmd, inspect_cmd
from megatron.training.checkpoint_tool.errors import ToolError

SUBCOMMANDS = (inspect_cmd, diff_cmd, convert_cmd)
PROG = "checkpoint.py"

USER_ERRORS = (ToolError, CheckpointError, ConfigError, FileNotFoundError, NotADirectoryError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, compare and convert megatron checkpoints (and Hugging Face directories).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{inspect,diff,convert}")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
