"""``checkpoint.py inspect DIR [--json] [--ckpt-step N]``: what one checkpoint holds, without reading a
tensor: iteration, consumed samples, FLOPs, the shape flags, the parallel layout it was saved under,
every tensor (global shape, dtype, bytes) grouped by layer and optimizer state, bytes per component,
whether its tensors were finite when saved, and every integrity problem found (listed, not raised).

Exit code 0 for an intact checkpoint, 1 when problems were found, 2 on a user error (not a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from megatron.training.checkpoint_tool.summary import GROUPS, Summary, summarize, table_heading

DESCRIPTION = (
    "What one checkpoint holds, without reading a tensor: iteration, consumed samples, FLOPs, shape flags, the "
    "parallel layout it was saved under, every tensor (global shape, dtype, bytes), bytes per component, whether "
    "its tensors were finite, and every integrity problem found. Exit code 0: intact; 1: problems found; "
    "2: not a checkpoint."
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="What a checkpoint holds: iteration, flags, layout, every tensor, bytes, integrity problems.",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "dir", metavar="DIR", help="a save directory (its tracker's checkpoint) or one iter_XXXXXXX"
    )
    parser.add_argument(
        "--ckpt-step", type=int, default=None, help="the iteration to inspect in a save directory"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (keys: docs/checkpoints.md)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summary = summarize(args.dir, args.ckpt_step)
    if args.json:
        json.dump(summary.to_json(), sys.stdout, indent=1, default=str)
        print()
    else:
        print("\n".join(text_lines(summary)))
    return 1 if summary.problems else 0


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _on_off(v: Any) -> str:
    return (
        {True: "on", False: "off", None: "?"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)
    )


def layout_line(summary: Summary) -> str:
    layout, source = summary.layout()
    if layout is None:
        return "not recorded"
    g = {k: ("?" if v is None else v) for k, v in layout.items()}
    older = " (from args['config']: saved before the layout was recorded)" if source == "args.config" else ""
    return (
        f"world size {g['world_size']}: tp {g['tensor_model_parallel_size']}, pp {g['pipeline_model_parallel_size']}, "
        f"vpp {g['virtual_pipeline_model_parallel_size']}, dp {g['data_parallel_size']}; sequence parallel "
        f"{_on_off(layout['sequence_parallel'])}, distributed optimizer {_on_off(layout['use_distributed_optimizer'])}, "
        f"FSDP2 {_on_off(layout['use_torch_fsdp2'])}{older}"
    )


def text_lines(summary: Summary) -> list[str]:
    """inspect's report, line by line."""
    j = summary.to_json()
    fmt = j["format"]
    finite = {True: "yes", False: "NO: it holds NaN or Inf", None: "not recorded"}[j["finite"]]
    lines = [
        f"checkpoint          {j['dir']}",
        f"format              {fmt.get('sharded_backend')} ({fmt.get('format')} version {fmt.get('format_version')}), "
        f"checkpoint_version {j['checkpoint_version']}",
        f"iteration           {j['iteration']}",
        f"consumed samples    train {j['consumed_train_samples']}, valid {j['consumed_valid_samples']}",
        f"FLOPs so far        {j['floating_point_operations']}",
        f"tensors finite      {finite}",
        f"contents            {', '.join(j['contents'] or []) or 'not recorded'}",
        f"layout              {layout_line(summary)}",
        "shape flags",
        *(f"  --{k.replace('_', '-')} {v}" for k, v in j["shape_flags"].items()),
        f"bytes               {human_bytes(j['bytes']['total'])} in all; on disk {human_bytes(sum(j['files'].values()))} "
        f"in {len(j['files'])} files",
    ]
    for group in GROUPS:
        n_t = sum(1 for t in j["tensors"] if t["group"] == group)
        n_o = sum(1 for o in j["objects"] if o["group"] == group)
        lines.append(f"  {group:<10} {human_bytes(j['bytes'][group]):>12}  ({n_t} tensors, {n_o} objects)")
    lines += _tensor_table(j["tensors"], j["objects"])
    lines.append(f"problems            {len(j['problems']) or 'none'}")
    lines += [f"  {p}" for p in j["problems"]]
    return lines


def _natural(text: str) -> list[Any]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _table_order(t: dict) -> tuple:
    head, name = table_heading(t["key"])
    return GROUPS.index(t["group"]), _natural(head), name


def _tensor_table(tensors: list[dict], objects: list[dict]) -> list[str]:
    """Every tensor under its heading (a layer, a top-level module, an optimizer state kind), then the objects."""
    lines = [f"tensors             {len(tensors)}"]
    width = max((len(table_heading(t["key"])[1]) for t in tensors), default=0)
    heading = None
    for t in sorted(tensors, key=_table_order):
        head, name = table_heading(t["key"])
        if head != heading:
            lines.append(f"  {head}")
            heading = head
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        lines.append(f"    {name:<{width}}  {shape:<16} {t['dtype']:<10} {human_bytes(t['bytes']):>10}")
    lines.append(f"objects             {len(objects)}")
    lines += [f"    {o['key']:<{width}}  {human_bytes(o['bytes']):>10} on disk" for o in objects]
    return lines
