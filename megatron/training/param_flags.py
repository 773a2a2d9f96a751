"""Rewriting the parameter names of a library error to an application's flags.

Light on purpose (no torch, no configs): the command-line tools use it with their own parsers'
flags (:func:`parser_flags`), ``pretrain_gpt.py`` through ``user_errors.flag_message`` with the
flags generated from the config dataclasses.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence

# A parameter's flag and the value it sets when it is a switch (None for a flag that takes a value).
FlagOf = Callable[[str], "tuple[str, bool | None] | None"]


def rewrite_params(message: str, params: Sequence[str], flag_of: FlagOf) -> str:
    """``message`` with each of ``params`` written as its flag: ``Config.param``, ``param=value``
    (``flag value``; for a switch ``flag`` or ``no flag``) and a bare ``param``, never part of a
    longer name or flag. A parameter without a flag (``flag_of`` gives None) stays as it is."""
    for param in params:
        found = flag_of(param)
        if found is not None:
            message = _rewrite(message, param, *found)
    return message


def _rewrite(message: str, param: str, flag: str, sets: bool | None) -> str:
    pattern = re.compile(
        rf"(?<![\w.-])(?:[A-Z]\w*\.)?{re.escape(param)}(?![\w-])(=(?:'(\w+)'|([^\s,;:)]+)))?"
    )

    def one(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return flag
        value = m.group(2) if m.group(2) is not None else m.group(3)
        if sets is not None and value in ("True", "False"):
            return flag if (value == "True") == sets else f"no {flag}"
        return f"{flag} {value}"

    return pattern.sub(one, message)


def parser_flags(parser: argparse.ArgumentParser) -> FlagOf:
    """``flag_of`` for a plain argparse parser: a dest's first long option (a store_true / store_false
    switch sets True / False)."""
    table: dict[str, tuple[str, bool | None]] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in table:
            sets = action.const if isinstance(action.const, bool) and action.nargs == 0 else None
            table[action.dest] = (longs[0], sets)
    return table.get
