"""``checkpoint.py diff DIR_A DIR_B [--atol X] [--rtol Y] [--model-only]``: what differs between two
checkpoints (each a save directory or one iter_XXXXXXX): flags (``--flag: A vs B``), common values
(iteration, consumed samples, ...), keys on one side only, tensors of another shape or dtype, and
tensors whose values differ beyond the tolerances (with their largest absolute and relative
difference). One tensor of each side is in memory at a time. ``--model-only`` compares the model's
tensors and the shape flags alone.

Exit code 0 when identical (within the tolerances), 1 when they differ, 2 on a user error.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from megatron.core.dist_checkpointing.consistency import component
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.reader import SavedCheckpoint
from megatron.training.run_config import config_flags

# Common values that are not compared as values: the args (compared as flags), the tensors' own record.
_NOT_VALUES = ("args",)


DESCRIPTION = (
    "What differs between two checkpoints: flags, common values (iteration, consumed samples), keys on one side "
    "only, tensors of another shape or dtype or whose values differ beyond --atol/--rtol. Exit code 0: identical; "
    "1: they differ; 2: a user error."
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="What differs between two checkpoints: flags, common values, keys, tensors (exit 1 if any).",
        description=DESCRIPTION,
    )
    parser.add_argument("dir_a", metavar="DIR_A")
    parser.add_argument("dir_b", metavar="DIR_B")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    parser.add_argument(
        "--model-only", action="store_true", help="compare the model's tensors and the shape flags only"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("atol", "rtol"):
        if not getattr(args, name) >= 0:
            raise ToolError(f"--{name} {getattr(args, name)} must be >= 0")
    a, b = SavedCheckpoint(args.dir_a), SavedCheckpoint(args.dir_b)
    sections: list[tuple[str, list[str]]] = [
        ("flags", flag_differences(a.args, b.args, args.model_only)),
        ("common values", [] if args.model_only else value_differences(a.common, b.common)),
    ]
    sections += key_differences(a, b, args.model_only)
    compared, tensor_lines = tensor_differences(a, b, args.atol, args.rtol, args.model_only)
    sections.append(("tensors that differ", tensor_lines))
    print(f"A: {a.dir}\nB: {b.dir}")
    differs = False
    for title, lines in sections:
        if lines:
            differs = True
            print(f"{title} ({len(lines)}):")
            print("\n".join(f"  {ln}" for ln in lines))
    tol = f"atol {args.atol}, rtol {args.rtol}"
    print(f"{'differ' if differs else 'identical'}: {compared} tensors compared ({tol})")
    return 1 if differs else 0


def _compared(key: str, model_only: bool) -> bool:
    return not model_only or component(key) == "model"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _same(a: Any, b: Any) -> bool:
    """Equal values; a saved callable's repr compared without its memory address."""
    if isinstance(a, str) and isinstance(b, str):
        return _ADDRESS.sub("", a) == _ADDRESS.sub("", b)
    return a == b


def _show(v: Any) -> str:
    return "(absent)" if v is _ABSENT else repr(v) if isinstance(v, str) else str(v)


_ABSENT = object()


def flag_differences(a: dict, b: dict, model_only: bool) -> list[str]:
    """``--flag: A vs B`` for each config field (args['config']) and top-level shape flag that differs;
    a ``--no-x`` switch shows whether it was on. Fields without a flag are ``section.field``."""
    lines: dict[str, str] = {}
    if not model_only:
        flags = config_flags()
        ca, cb = a.get("config") or {}, b.get("config") or {}
        for section in sorted(set(ca) | set(cb)):
            sa, sb = ca.get(section) or {}, cb.get(section) or {}
            for name in sorted(set(sa) | set(sb)):
                va, vb = sa.get(name, _ABSENT), sb.get(name, _ABSENT)
                if _same(va, vb):
                    continue
                flag = flags.get((section, name))
                if flag and flag.startswith("--no-") and isinstance(va, bool) and isinstance(vb, bool):
                    va, vb = not va, not vb  # the switch's state
                label = flag or f"{section}.{name}"
                lines.setdefault(label, f"{label}: {_show(va)} vs {_show(vb)}")
    for name in sorted((set(a) | set(b)) - {"config"}):
        va, vb = a.get(name, _ABSENT), b.get(name, _ABSENT)
        if isinstance(va, dict) or isinstance(vb, dict):
            da, db = va if isinstance(va, dict) else {}, vb if isinstance(vb, dict) else {}
            for k in sorted(set(da) | set(db)):
                if not _same(da.get(k, _ABSENT), db.get(k, _ABSENT)):
                    lines.setdefault(
                        f"{name}.{k}",
                        f"{name}.{k}: {_show(da.get(k, _ABSENT))} vs {_show(db.get(k, _ABSENT))}",
                    )
            continue
        label = "--" + name.replace("_", "-")
        if not _same(va, vb):
            lines.setdefault(label, f"{label}: {_show(va)} vs {_show(vb)}")
    return list(lines.values())


def value_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """``name: A vs B`` for each common value (nested dicts by dotted name) that differs."""
    lines = []
    for name in sorted(set(a) | set(b), key=str):
        if not prefix and name in _NOT_VALUES:
            continue
        va, vb = a.get(name, _ABSENT), b.get(name, _ABSENT)
        if isinstance(va, dict) and isinstance(vb, dict):
            lines += value_differences(va, vb, f"{prefix}{name}.")
        elif not _same(va, vb):
            lines.append(f"{prefix}{name}: {_show(va)} vs {_show(vb)}")
    return lines


def key_differences(a: SavedCheckpoint, b: SavedCheckpoint, model_only: bool) -> list[tuple[str, list[str]]]:
    """(title, lines) of the tensors and objects only one side holds, and of the tensors whose shape or
    dtype differ."""
    ta = {k for k in a.tensors if _compared(k, model_only)}
    tb = {k for k in b.tensors if _compared(k, model_only)}
    oa = set() if model_only else set(a.objects)
    ob = set() if model_only else set(b.objects)
    changed = []
    for k in sorted(ta & tb):
        (sa, da), (sb, db) = a.tensors[k], b.tensors[k]
        if sa != sb or da != db:
            changed.append(f"{k}: {list(sa)} {_dtype(da)} vs {list(sb)} {_dtype(db)}")
    return [
        ("only in A", [f"tensor {k}" for k in sorted(ta - tb)] + [f"object {k}" for k in sorted(oa - ob)]),
        ("only in B", [f"tensor {k}" for k in sorted(tb - ta)] + [f"object {k}" for k in sorted(ob - oa)]),
        ("tensors of another shape or dtype", changed),
    ]


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def tensor_differences(
    a: SavedCheckpoint, b: SavedCheckpoint, atol: float, rtol: float, model_only: bool
) -> tuple[int, list[str]]:
    """(tensors compared, a line per tensor of the same shape and dtype on both sides whose values
    differ: ``|a - b| > atol + rtol * |b|`` somewhere, NaN equal to NaN)."""
    lines, compared = [], 0
    for key in sorted(set(a.tensors) & set(b.tensors)):
        if not _compared(key, model_only) or a.tensors[key] != b.tensors[key]:
            continue
        compared += 1
        max_abs, max_rel, differs = compare(a.read(key), b.read(key), atol, rtol)
        if differs:
            lines.append(f"{key}: max abs diff {max_abs:.6g}, max rel diff {max_rel:.6g}")
    return compared, lines


def compare(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    """(max |x - y|, max |x - y| / |y|, whether some element differs beyond ``atol + rtol * |y|``);
    in float64, NaN equal to NaN, an infinity equal to itself; the relative difference where y is 0
    and x is not is infinite."""
    if x.numel() == 0:
        return 0.0, 0.0, False
    xd, yd = x.to(torch.float64), y.to(torch.float64)
    same = (xd == yd) | (torch.isnan(xd) & torch.isnan(yd))
    diff = torch.where(same, torch.zeros_like(xd), (xd - yd).abs().nan_to_num(nan=float("inf")))
    scale = yd.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale)  # x / 0 = inf for x > 0
    differs = bool((diff > atol + rtol * scale.nan_to_num(nan=0.0)).any())
    return float(diff.max()), float(rel.max()), differs
