"""The directories of one checkpoint while it is written and replaced, and the repair after a kill.

A save writes ``<save>/iter_0000100.saving/`` and renames it to ``iter_0000100`` once it is complete
(``metadata.json``, written last, is in it). Saving an iteration that already has a checkpoint first
renames the old one aside to ``iter_0000100.replaced`` and removes it only once the new one is in
place. So at every instant a complete checkpoint of the iteration exists under one of three names,
and a save killed at any point (kill -9 included) leaves one behind:

    killed while                             complete checkpoint of the iteration
    writing .saving                          iter_0000100 (the old one)
    between the two renames                  .saving (the new one) and .replaced (the old one)
    removing .replaced                       iter_0000100 (the new one)

``resolve`` names the directory a load reads (``iter_0000100``, else a complete ``.saving``, else a
complete ``.replaced``); ``repair`` (one rank, before the others read) renames it back to
``iter_0000100``. A ``.saving`` directory never looks like a checkpoint to anything that reads
``iter_*`` names by the tracker; the next save of that iteration removes it.

The tracker, ``<save>/latest_checkpointed_iteration.txt``, holds the integer iteration of the newest
complete checkpoint (``read_tracker`` / ``write_tracker``; it is replaced atomically).

Retention (``--ckpt-keep-last``, ``--save-retain-interval``: ``retention_victims``, ``apply_retention``)
deletes complete ``iter_XXXXXXX`` directories older than the one the tracker has just been pointed at,
``metadata.json`` first; nothing else in the save directory is ever deleted.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import METADATA_FILE, CheckpointError, is_complete_checkpoint

SAVING = ".saving"
REPLACED = ".replaced"
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7,})")


def iteration_dir(root: str, iteration: int) -> str:
    """``<root>/iter_{iteration:07d}``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration named by ``<root>/latest_checkpointed_iteration.txt``, or None without one.

    Raises:
        CheckpointError: the tracker holds something other than an integer (``release`` is read only
            for legacy ``torch`` checkpoints, by ``legacy_checkpoint``).
    """
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} is not text (byte {raw[e.start]:#04x} at offset {e.start}); it must hold the iteration of a "
            f"complete iter_XXXXXXX directory in {root}: rewrite it (e.g. echo 100 > {path}) or pass --ckpt-step N"
        ) from None
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} holds {text!r}, not an iteration number; write the iteration of a complete "
            f"iter_XXXXXXX directory in {root} into it (e.g. 100)"
        ) from None


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at ``iteration``: temp file, fsync, ``os.replace``, fsync dir."""
    path = os.path.join(root, TRACKER_FILENAME)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(root)


def staging_dir(ckpt_dir: str) -> str:
    """Where the checkpoint ``ckpt_dir`` is written before it is renamed into place."""
    return ckpt_dir + SAVING


def aside_dir(ckpt_dir: str) -> str:
    """Where the previous checkpoint ``ckpt_dir`` waits while a new one replaces it."""
    return ckpt_dir + REPLACED


def fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (where the platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open directories; the rename itself is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def remove_staging(ckpt_dir: str) -> None:
    """Remove what an earlier, interrupted save of ``ckpt_dir`` left in its staging directory."""
    staging = staging_dir(ckpt_dir)
    if os.path.lexists(staging):
        shutil.rmtree(staging)


def swap_in(ckpt_dir: str) -> None:
    """Rename the complete staging directory to ``ckpt_dir``, replacing (never first deleting) a
    complete checkpoint there: see the module docstring for the state a kill leaves at each step."""
    staging, aside = staging_dir(ckpt_dir), aside_dir(ckpt_dir)
    assert is_complete_checkpoint(staging), staging
    parent = os.path.dirname(ckpt_dir) or "."
    if os.path.isdir(ckpt_dir):
        if is_complete_checkpoint(ckpt_dir):
            if os.path.lexists(aside):  # left by a kill after an earlier swap: ckpt_dir is the newer one
                shutil.rmtree(aside)
            _rename(ckpt_dir, aside)
        else:  # an incomplete directory (a save by an earlier version of this code): nothing to keep
            shutil.rmtree(ckpt_dir)
    _rename(staging, ckpt_dir)
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def resolve(ckpt_dir: str) -> str:
    """The directory that holds the complete checkpoint ``ckpt_dir`` (see the module docstring);
    ``ckpt_dir`` itself when there is none, for the caller to report."""
    for candidate in (ckpt_dir, staging_dir(ckpt_dir), aside_dir(ckpt_dir)):
        if is_complete_checkpoint(candidate):
            return candidate
    return ckpt_dir


def repair(ckpt_dir: str, log: Callable[[str], None]) -> None:
    """Finish or undo a swap that a kill interrupted, so that ``ckpt_dir`` is the complete checkpoint
    again; run on one rank before any rank reads. Where the directory cannot be renamed (a read-only
    file system) the load reads the checkpoint where it is (``resolve``)."""
    if os.path.isdir(ckpt_dir):
        if is_complete_checkpoint(ckpt_dir):
            shutil.rmtree(aside_dir(ckpt_dir), ignore_errors=True)  # left by a kill after a finished swap
        return
    found = resolve(ckpt_dir)
    if found == ckpt_dir:
        return
    try:
        _rename(found, ckpt_dir)
        fsync_dir(os.path.dirname(ckpt_dir) or ".")
    except OSError as e:
        log(
            f"note: a save that was killed left {ckpt_dir} as {found}; reading it there (cannot rename it "
            f"back: {e})"
        )
        return
    log(f"note: a save that was killed left {ckpt_dir} as {found}; renamed it back")
    if found == staging_dir(ckpt_dir):
        shutil.rmtree(aside_dir(ckpt_dir), ignore_errors=True)


def complete_iterations(root: str, suffixes: tuple[str, ...] = ("", SAVING, REPLACED)) -> list[int]:
    """The iterations of ``root`` that have a complete checkpoint under some name, newest first; with
    ``suffixes=("",)`` only those named exactly ``iter_XXXXXXX``."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = set()
    for name in names:
        for suffix in suffixes:
            match = _ITER_DIR.fullmatch(name[: len(name) - len(suffix)]) if name.endswith(suffix) else None
            if match and is_complete_checkpoint(os.path.join(root, name)):
                found.add(int(match.group(1)))
    return sorted(found, reverse=True)


def _holds_checkpoint_files(path: str) -> bool:
    """``path`` holds files of a torch_dist or legacy checkpoint (complete or not) and no tracker."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if TRACKER_FILENAME in names:
        return False
    return any(
        n in ("metadata.json", ".metadata") or n.endswith(".distcp") or n.startswith("mp_rank_")
        for n in names
    )


def split_iteration_dir(path: str) -> tuple[str, int | None]:
    """``(parent, N)`` when ``path`` is one checkpoint ``.../iter_000000N`` (its files are in it, and
    no tracker: it is not the directory of a run); ``(path, None)`` otherwise."""
    norm = os.path.normpath(path)
    match = _ITER_DIR.fullmatch(os.path.basename(norm))
    if match is None or not _holds_checkpoint_files(norm):
        return path, None
    return os.path.dirname(norm) or ".", int(match.group(1))


def _why_not_writable(path: str) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    return "a read-only file system" if read_only else "no write permission"


def check_save_dir(path: str) -> None:
    """``--save``: a directory (or one that can be created) this process can write, not one checkpoint.

    Raises:
        ConfigError: naming the path and what is wrong with it.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"--save {path} is a file, not a directory; pass a directory (it is created if missing)"
        )
    if os.path.isdir(path):
        if is_complete_checkpoint(path):
            raise ConfigError(
                f"--save {path} is one checkpoint (it holds metadata.json); pass the directory that "
                f"holds the checkpoints, {os.path.dirname(os.path.normpath(path)) or '.'}"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(
                f"--save {path} is not writable ({_why_not_writable(path)}); pass a directory you can write"
            )
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"--save {path} cannot be created: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--save {path} cannot be created: {ancestor} is not writable ({_why_not_writable(ancestor)}); "
            "pass a directory you can write"
        )


def retention_victims(
    root: str, newest: int, previous: int | None, keep_last: int | None, retain_interval: int | None
) -> dict[int, str]:
    """The iterations to delete once ``newest`` is complete and tracked (``--ckpt-keep-last``,
    ``--save-retain-interval``), with the flag that deletes each.

    Only complete ``iter_XXXXXXX`` directories older than ``newest`` are candidates (a checkpoint of a
    later iteration, left by a run that went further, is never touched). ``keep_last`` N keeps ``newest``
    and the N - 1 newest older ones; ``retain_interval`` R deletes ``previous`` (what the tracker named
    before ``newest``) unless its iteration is a multiple of R, and keeps every multiple of R from
    ``keep_last`` too.
    """
    older = [it for it in complete_iterations(root, suffixes=("",)) if it < newest]
    retained = {it for it in older if retain_interval and it % retain_interval == 0}
    victims: dict[int, str] = {}
    if retain_interval is not None and previous in older and previous not in retained:
        victims[previous] = f"--save-retain-interval {retain_interval}: {previous} is not a multiple of it"
    if keep_last is not None:
        for it in older[keep_last - 1 :]:
            if it not in retained:
                victims.setdefault(it, f"--ckpt-keep-last {keep_last}")
    return dict(sorted(victims.items()))


def delete_checkpoint(root: str, iteration: int, why: str, log: Callable[[str], None]) -> bool:
    """Delete ``iter_XXXXXXX`` of ``root``: its ``metadata.json`` first, so that a kill while the files go
    leaves an incomplete directory (never loaded) rather than a complete-looking, partial one. A failure
    is a warning line (the run goes on). Returns whether it was deleted."""
    path = iteration_dir(root, iteration)
    marker = os.path.join(path, METADATA_FILE)
    try:
        if os.path.isfile(marker):
            os.remove(marker)
            fsync_dir(path)
        shutil.rmtree(path)
    except OSError as e:
        log(f"warning: could not delete {path} ({why}): {e}")
        return False
    log(f"  deleted checkpoint {path} ({why})")
    return True


def apply_retention(
    root: str,
    newest: int,
    previous: int | None,
    keep_last: int | None,
    retain_interval: int | None,
    log: Callable[[str], None],
) -> list[int]:
    """Rank 0, once the tracker names ``newest``: delete what ``retention_victims`` names, one log line
    each. Returns the deleted iterations."""
    victims = retention_victims(root, newest, previous, keep_last, retain_interval)
    return [it for it, why in victims.items() if delete_checkpoint(root, it, why, log)]
