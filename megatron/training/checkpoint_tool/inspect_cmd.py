"""``checkpoint.py inspect`` (being built)."""

from __future__ import annotations

import argparse

from megatron.training.checkpoint_tool.errors import ToolError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="(being built)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise ToolError("inspect is being built")
