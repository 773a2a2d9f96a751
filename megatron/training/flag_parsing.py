"""The argparse pieces behind ``arguments``: a parser that collects every mistake of a command line
instead of stopping at the first, and the reading of argument lists it needs (negative numbers as
values, the names of unknown flags with a close spelling)."""

from __future__ import annotations

import argparse
import decimal
import difflib
import math
import re

from megatron.training.megatron_flag_table import refusal_for_unlisted
from megatron.training.megatron_flags import Arity


class ParseStop(Exception):
    """argparse met a mistake it cannot parse past (a flag missing its value)."""


class Parser(argparse.ArgumentParser):
    """Collects every mistake of one command line, so that all of them are reported at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mistakes: list[str] = []

    def error(self, message: str):
        raise ParseStop(message)


class Value(argparse.Action):
    """Stores a flag's converted value; a value of the wrong type or outside the choices is recorded
    as a mistake (reported with every other mistake of the launch) instead of stopping the parse."""

    def __init__(self, option_strings, dest, convert=str, allowed=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.convert, self.allowed = convert, allowed

    def __call__(self, parser, namespace, values, option_string=None):
        many = isinstance(values, list)
        out = []
        for raw in values if many else [values]:
            try:
                value = self.convert(raw)
            except ValueError:
                what = self.convert.__name__ if isinstance(self.convert, type) else "value"
                example = getattr(self.convert, "example", None) or _EXAMPLE.get(self.convert, "x")
                parser.mistakes.append(
                    f"{option_string} {raw}: not a valid {what}, e.g. {option_string} {example}"
                )
                continue
            if self.allowed and value not in self.allowed:
                parser.mistakes.append(
                    f"{option_string} {raw}: choose one of {', '.join(map(str, self.allowed))}"
                )
                continue
            out.append(value)
        setattr(namespace, self.dest, out if many else (out[0] if out else None))


_EXAMPLE = {int: "8", float: "0.1", str: "x"}


def _close_flag(flag: str, known: list[str]) -> str | None:
    """A known flag that is really close to ``flag`` (a typo), or None: a wrong guess misleads more
    than no guess (``--skip-train`` is not a misspelling of ``--clip-grad``)."""
    names = {k[2:]: k for k in known}
    close = difflib.get_close_matches(flag[2:], list(names), n=1, cutoff=0.8)
    return names[close[0]] if close else None


def unknown(extras: list[str], known: list[str]) -> list[str]:
    """One line per argument the parser did not take (values after an unknown flag are its values)."""
    lines, after_flag = [], False
    for arg in extras:
        if arg.startswith("--"):
            name = arg.split("=")[0]
            why = refusal_for_unlisted(name)  # a family of flags refused as a whole (--moe-*)
            if why:
                lines.append(f"{name}: {why}")
            else:
                close = _close_flag(name, known)
                hint = f"; did you mean {close}?" if close else ""
                lines.append(f"{name}: not a flag of pretrain_gpt.py nor of Megatron-LM 0.19.2{hint}")
            after_flag = True
        elif not after_flag:
            lines.append(f"{arg}: unexpected value (pretrain_gpt.py takes flags only)")
    return lines


def _is_negative_number(token: str) -> bool:
    """``-5``, ``-.5``, ``-1e-3``, ``-1,50,50``, ``-inf``: a value, never a flag (no flag starts with a
    digit). argparse itself takes only ``-5`` and ``-0.5`` as values and the others as flags."""
    return bool(re.match(r"-\.?\d", token)) or token.lower() in ("-inf", "-infinity", "-nan")


def _plain_decimal(token: str) -> str:
    """The same negative number in a spelling argparse takes as a value (``-1e-3`` -> ``-0.001``), or
    ``token`` itself where there is none (``-1,50,50``, ``-inf``)."""
    try:
        plain = format(decimal.Decimal(token), "f")
    except decimal.InvalidOperation:
        return token
    return plain if re.fullmatch(r"-\d+|-\d*\.\d+", plain) else token


def attach_negative_values(argv: list[str], arity: dict[str, Arity]) -> list[str]:
    """``argv`` with each negative number that follows a flag taking values bound to that flag, so that
    the flag's own check judges it: ``--lr -1e-3`` -> ``--lr=-1e-3`` (a flag of one value); ``--data-path
    -1e-3 a`` -> ``--data-path -0.001 a`` (a flag of several values, which ``=`` would cut to one).
    ``arity`` maps every flag to its argparse nargs (0: a switch). A negative number after a switch or
    past a flag's last value is left alone, and reported as a stray value."""
    out: list[str] = []
    room: float = 0  # values the last flag may still take
    single = False  # the last flag takes one value and is the last token of ``out``
    for token in argv:
        if token in arity:
            nargs = arity[token]
            single = nargs in (None, "?")
            room = math.inf if nargs in ("*", "+") else 1 if single else int(nargs or 0)
            out.append(token)
            continue
        if room and _is_negative_number(token):
            if single:
                out[-1] = f"{out[-1]}={token}"
            else:
                out.append(_plain_decimal(token))
        else:
            out.append(token)
            if token.startswith("-"):  # another flag (unknown, or --flag=value): the last one's values end
                room = 0
        room, single = max(room - 1, 0), False
    return out
