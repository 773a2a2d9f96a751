"""How ``load`` treats a mismatch between the request and the checkpoint (``strict=``).

*Unexpected* keys are requested by this rank but not in the checkpoint: sharded keys, and plain
(common) values of the request that the checkpoint does not hold (named by their dotted path). They
are never loaded. *Missing* keys are in the checkpoint but requested by no rank (found only by the
``*_ALL`` modes, which gather every rank's keys).
"""

from __future__ import annotations

import logging
from enum import Enum

from megatron.core.config_utils import ConfigError

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """The ``strict`` modes of ``load`` (Megatron-Core's names and values).

    ``ASSUME_OK_UNEXPECTED`` (the default): an unexpected sharded key is an error (raised on every
    rank, before anything is read); an unexpected plain value is left out of the result. The
    ``*_UNEXPECTED`` modes report unexpected keys only, the ``*_ALL`` modes also missing keys:
    ``LOG_*`` logs them (warning) and loads the rest, ``RAISE_*`` raises ``CheckpointError`` on every
    rank before reading, ``RETURN_*`` makes ``load`` return ``(state_dict, missing_keys,
    unexpected_keys)``. ``IGNORE_ALL`` loads what exists and says nothing.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """The mode compares the request with the checkpoint's keys before loading."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """The mode needs every rank's requested keys (it finds missing keys)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """``load`` returns ``(state_dict, missing_keys, unexpected_keys)`` in this mode."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | bool | StrictHandling) -> StrictHandling:
    """A ``StrictHandling`` from itself, its value string (``"log_all"``) or a bool: True is
    ``ASSUME_OK_UNEXPECTED`` and False ``LOG_UNEXPECTED`` (as Megatron-Core's ``load`` documents).

    Raises:
        ConfigError: any other value, naming ``strict`` and the valid strings.
    """
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError):
        valid = ", ".join(repr(m.value) for m in StrictHandling)
        raise ConfigError(
            f"strict={strict!r} is not a strict handling mode; use one of {valid}", params=("strict",)
        ) from None


def wants_missing(strict: StrictHandling) -> bool:
    """Whether missing keys are to be found (gathering every rank's requested keys)."""
    return StrictHandling.requires_global_app_metadata(strict)


def mismatch_errors(strict: StrictHandling, missing: set[str], unexpected: set[str]) -> list[str]:
    """The error lines a ``RAISE_*`` mode raises for the mismatch (empty: nothing to raise). The
    default mode's errors (unexpected sharded keys) are found by ``validation.validate_load_request``."""
    if strict not in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        return []
    errors = [f"unexpected key {k!r}: requested but not in the checkpoint" for k in sorted(unexpected)]
    if strict == StrictHandling.RAISE_ALL:
        errors += [f"missing key {k!r}: in the checkpoint but requested by no rank" for k in sorted(missing)]
    return errors


def report_mismatch(
    strict: StrictHandling, checkpoint_dir: str, missing: set[str], unexpected: set[str]
) -> None:
    """Log the mismatch in the ``LOG_*`` modes (one warning)."""
    if strict not in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) or not (missing or unexpected):
        return
    parts = []
    if unexpected:
        parts.append(f"unexpected keys (requested by this rank, not in the checkpoint): {sorted(unexpected)}")
    if missing:
        parts.append(f"missing keys (in the checkpoint, requested by no rank): {sorted(missing)}")
    logger.warning("loading %s: %s", checkpoint_dir, "; ".join(parts))
