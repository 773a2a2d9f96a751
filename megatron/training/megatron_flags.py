"""Megatron-LM's training flags that are not fields of our configs, each handled on purpose.

Every flag of Megatron-LM's ``pretrain_gpt.py`` is in exactly one of four classes (docs/flags.md
lists them; a test walks all 846 flags of Megatron-LM 0.19.2):

- implemented: a flag of our parser, generated from a config field or an alias (arguments.py);
- ``ALWAYS``: accepted because it asks for what this package always does (a note says so once);
- ``NO_EFFECT``: accepted with a note that it has no effect here, and why (a knob of a Megatron
  internal this package does not have);
- ``REFUSED``: the run stops before any work with one line saying what to use instead.

Each entry records the flag's arity as Megatron-LM parses it, so that a script's values are
consumed exactly as Megatron would and never mistaken for other flags. The table itself lives in
``megatron_flag_table``; this module holds the entry type and the argparse glue.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ALWAYS = "always"
NO_EFFECT = "no effect"
REFUSED = "refused"
KINDS = (ALWAYS, NO_EFFECT, REFUSED)

# argparse arity: 0 a switch, None exactly one value, "?", "*", "+" or a count.
Arity = int | str | None


@dataclass(frozen=True)
class ForeignFlag:
    """One Megatron-LM flag that is not a field of our configs.

    Attributes:
        flag: the spelling, e.g. ``--manual-gc``.
        kind: ``ALWAYS``, ``NO_EFFECT`` or ``REFUSED``.
        why: for ALWAYS / NO_EFFECT what this package does instead (the note printed when the flag is
            given); for REFUSED what to use instead.
        nargs: the arity Megatron-LM parses the flag with.
        accepted: for a flag with a value, the values taken as ``kind``; any other value is refused
            with ``otherwise`` (e.g. ``--context-parallel-size`` is accepted at 1 only). None: any value.
        otherwise: the refusal for a value outside ``accepted``.
    """

    flag: str
    kind: str
    why: str
    nargs: Arity = 0
    accepted: tuple[str, ...] | None = None
    otherwise: str = ""

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.flag.startswith("--"), self


def entries(kind: str, why: str, spec: str) -> list[ForeignFlag]:
    """ForeignFlags of one kind and reason from a whitespace-separated list of flags.

    A bare flag is a switch; ``--flag=1`` takes one value, ``--flag=?``/``=*``/``=+`` take optional,
    any or at least one value, ``--flag=N`` exactly N values.
    """
    out = []
    for item in spec.split():
        flag, _, arity = item.partition("=")
        nargs: Arity = 0
        if arity == "1":
            nargs = None
        elif arity in ("?", "*", "+"):
            nargs = arity
        elif arity:
            nargs = int(arity)
        out.append(ForeignFlag(flag, kind, why, nargs))
    return out


def index(table: list[ForeignFlag]) -> dict[str, ForeignFlag]:
    """{flag: entry}; a flag listed twice is a bug in the table."""
    out: dict[str, ForeignFlag] = {}
    for e in table:
        assert e.flag not in out, f"{e.flag} is listed twice"
        out[e.flag] = e
    return out


# Where the parser keeps the foreign flags it saw: [(entry, value as given)].
GIVEN = "_megatron_flags_given"


class _Record(argparse.Action):
    """Records that a foreign flag was given (and its value); it sets no config field."""

    def __init__(self, option_strings, dest, entry: ForeignFlag, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.entry = entry

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, GIVEN, None) or []
        seen.append((self.entry, values))
        setattr(namespace, GIVEN, seen)


def register(parser: argparse.ArgumentParser, table: dict[str, ForeignFlag]) -> None:
    """Add every entry as a hidden flag of ``parser`` with Megatron's arity (--help-megatron lists them)."""
    for e in table.values():
        parser.add_argument(
            e.flag,
            action=_Record,
            entry=e,
            nargs=e.nargs,
            dest=GIVEN,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def _shown(values) -> str:
    if values is None or values == []:
        return ""
    return " " + (" ".join(map(str, values)) if isinstance(values, list) else str(values))


def judge(given: list) -> tuple[list[str], list[str]]:
    """(notes on the accepted flags, refusals) for the foreign flags of one launch: one line per
    reason, naming every flag (with its value) that it covers."""
    lines: dict[tuple[str, str], list[str]] = {}
    for entry, values in given:
        shown = f"{entry.flag}{_shown(values)}"
        if entry.kind == REFUSED:
            key = (REFUSED, entry.why)
        elif entry.accepted is not None and _shown(values).strip() not in entry.accepted:
            key = (REFUSED, entry.otherwise)
        else:
            key = (entry.kind, entry.why)
        if shown not in lines.setdefault(key, []):
            lines[key].append(shown)
    notes, refusals = [], []
    for (kind, why), flags in lines.items():
        named = ", ".join(flags)
        if kind == REFUSED:
            refusals.append(f"{named}: {why}")
        elif kind == ALWAYS:
            notes.append(f"note: {named}: accepted, this package always does so: {why}")
        else:
            notes.append(f"note: {named}: accepted, no effect here: {why}")
    return notes, refusals
