"""The hang report: which ranks never arrived at the collective the others wait in, and every live
rank's Python stack, printed once and written to a file when the job stops for a lost rank or a hang.

What a rank knows of its own collectives comes from PyTorch's flight recorder (gloo and NCCL record
every collective they run, in C++, when ``TORCH_FR_BUFFER_SIZE`` > 0; ``initialize`` sets 2000 unless
it is set): per process group the sequence number of the last collective entered and of the last
completed, which the watcher thread reads every second (about 15 us) and publishes with the rank's
heartbeat, and, at report time, the recorded entries (operation, group, sequence number). Nothing is
added to the training step: no wrapper around ``torch.distributed``, no store traffic.

A rank whose collective has been pending for its budget (``pending_for``) stops the job; every live
rank then publishes its ``Part`` (the main thread's stack, read by the watcher thread with
``sys._current_frames``, and its recent collectives) in the job's store, and the first rank to report
composes ``compose`` from the parts and the heartbeats of the ranks that cannot answer (a stopped
process runs no thread: "stopped: no stack").
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

FR_BUFFER_SIZE = "2000"  # entries kept per process (NCCL's own default); TORCH_FR_BUFFER_SIZE wins
RECENT = 4  # collectives per rank shown in the report (the flight recorder holds more)
STACK_LINES = 60  # lines of a rank's stack kept in the report (the innermost)

# The ParallelState's group names, in the order a shared process group is named by (dp and dp_cp
# are one group when cp is 1: it is called data-parallel).
GROUP_LABELS = {
    "dp": "data-parallel",
    "tp": "tensor-parallel",
    "pp": "pipeline-parallel",
    "cp": "context-parallel",
    "ep": "expert-parallel",
    "dp_cp": "data-and-context-parallel",
    "mp": "model-parallel",
    "tp_cp": "tensor-and-context-parallel",
    "tp_dp": "tensor-and-data-parallel",
    "tp_dp_cp": "tensor-data-and-context-parallel",
    "expt_tp": "expert-tensor-parallel",
    "expt_dp": "expert-data-parallel",
    "tp_ep": "tensor-and-expert-parallel",
    "tp_ep_pp": "tensor-expert-and-pipeline-parallel",
    "embedding": "embedding",
    "position_embedding": "position-embedding",
    "intra_dist_opt": "distributed-optimizer instance",
}


def enable_flight_recorder() -> None:
    """Before ``init_process_group``: the backends read the buffer size when they start."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_SIZE)


def _dump(collectives: bool) -> dict | None:
    """The flight recorder's state (torch >= 2.8 for gloo; NCCL's older entry point otherwise);
    None when this torch has none or records nothing."""
    c10d = torch._C._distributed_c10d
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            return pickle.loads(fn(collectives, False, False))
        except Exception:  # a backend that cannot dump (none initialised): try the next
            continue
    return None


def recording() -> bool:
    """This torch has a flight recorder and it records (after ``init_process_group``)."""
    return _dump(collectives=False) is not None


# The recorder's status is keyed by each process group's id in this process (groups this rank is not
# in get none), its entries name the group too: ``entries`` learns id -> name, for every rank to use
# the group's name, which all ranks share.
_NAMES: dict[str, str] = {}
_TRIED: dict[str, float] = {}  # id -> when ``sequence_numbers`` last read the entries to learn it
LEARN_EVERY_S = 10.0  # an id the entries no longer hold (its one collective evicted): how often to retry


def sequence_numbers() -> dict[str, tuple[int, int]]:
    """{process group name: (last collective entered, last completed)} from the flight recorder."""
    state = _dump(collectives=False) or {}
    status = {str(i): s for i, s in state.get("pg_status", {}).items()}
    now = time.monotonic()
    unknown = [i for i in status if i not in _NAMES and now - _TRIED.get(i, -LEARN_EVERY_S) >= LEARN_EVERY_S]
    if unknown:  # a group's first collectives: learn its name at once, while the entries hold them
        _TRIED.update(dict.fromkeys(unknown, now))
        entries()
    out = {}
    for i, s in status.items():
        out[_NAMES.get(i, f"id{i}")] = (
            int(s.get("last_enqueued_collective", -1)),
            int(s.get("last_completed_collective", -1)),
        )
    return out


def encode_seqs(seqs: dict[str, tuple[int, int]]) -> str:
    """The heartbeat's field: ``pg:entered`` pairs, ``-`` when none (no spaces: beats split on them)."""
    return ",".join(f"{pg}:{entered}" for pg, (entered, _) in sorted(seqs.items())) or "-"


def decode_seqs(text: str) -> dict[str, int]:
    if text in ("", "-"):
        return {}
    return {pg: int(n) for pg, n in (item.split(":") for item in text.split(","))}


@dataclass
class Pending:
    """A collective this rank has entered and not finished, seen by its watcher thread."""

    pg: str
    seq: int
    since: float  # the watcher's monotonic clock when it first saw it pending


def pending_for(seqs: dict[str, tuple[int, int]], seen: dict[str, Pending], now: float) -> Pending | None:
    """Update ``seen`` (pg -> the oldest pending collective) from the flight recorder's numbers and
    return the one pending longest, if any."""
    for pg, (entered, completed) in seqs.items():
        if entered <= completed:
            seen.pop(pg, None)
        elif pg not in seen or seen[pg].seq != completed + 1:
            seen[pg] = Pending(pg, completed + 1, now)
    for pg in [pg for pg in seen if pg not in seqs]:
        del seen[pg]
    return min(seen.values(), key=lambda p: p.since, default=None)


def group_names(groups: dict, group_ranks: dict[str, list[int]]) -> dict[str, list]:
    """{process group name: [label, ranks]} for the ParallelState's groups (``groups``: name -> group),
    the default group as ``world``."""
    out: dict[str, list] = {}
    if dist.is_initialized():
        world = dist.group.WORLD
        out[world.group_name] = ["world group", list(range(dist.get_world_size()))]
    for name in [*GROUP_LABELS, *groups]:
        group = groups.get(name)
        if group is None or group.group_name in out:
            continue
        out[group.group_name] = [f"{GROUP_LABELS.get(name, name)} group ({name})", group_ranks.get(name, [])]
    return out


def lookup_group(pg: str, names: dict[str, list]) -> list:
    """[label, ranks] of process group ``pg``: from ``names``, else from torch's own table (a group
    made outside the ParallelState, such as FSDP's), added to ``names``."""
    if pg not in names:
        for group, name in getattr(dist.distributed_c10d._world, "pg_names", {}).items():
            if name == pg:
                try:
                    names[pg] = [f"process group {pg}", dist.get_process_group_ranks(group)]
                except (ValueError, RuntimeError):
                    break
                break
    return names.get(pg, [f"process group {pg}", []])


def describe_group(pg: str, names: dict[str, list]) -> str:
    label, ranks = names.get(pg, [f"process group {pg}", []])
    the = "" if label.startswith("process group") else "the "
    return f"{the}{label} {list(ranks)}" if ranks else f"{the}{label}"


def collective_text(op: str, seq: int, pg: str, names: dict[str, list]) -> str:
    """e.g. ``all_reduce #57 on the data-parallel group (dp) [0, 1]``."""
    return f"{op or 'a collective'} #{seq} on {describe_group(pg, names)}"


def entries() -> list[dict]:
    """The flight recorder's entries, oldest first, each as op, pg, seq, p2p, done."""
    state = _dump(collectives=True) or {}
    out = []
    for e in state.get("entries", []):
        name = str(e.get("profiling_name", ""))
        p2p = bool(e.get("is_p2p"))
        pg = str((e.get("process_group") or ("?",))[0])
        _NAMES[str(e.get("pg_id"))] = pg
        out.append(
            dict(
                op=name.split(":", 1)[-1],
                pg=pg,
                seq=int(e.get("p2p_seq_id" if p2p else "collective_seq_id", -1)),
                p2p=p2p,
                done=bool(e.get("retired")) or e.get("state") == "completed",
            )
        )
    return out


def op_of(recorded: list[dict], pg: str, seq: int) -> str:
    """The operation of collective ``seq`` on ``pg`` ("" when the recorder no longer holds it)."""
    for e in reversed(recorded):
        if not e["p2p"] and e["pg"] == pg and e["seq"] == seq:
            return e["op"]
    return ""


def main_thread_stack() -> list[str]:
    """The main thread's Python stack, innermost last, read from another thread."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    return _lines(traceback.extract_stack(frame))


def exception_stack(error: BaseException) -> list[str]:
    """Where the main thread was when ``error`` ended its wait (a collective's timeout)."""
    return _lines(traceback.extract_tb(error.__traceback__))


def _lines(frames: traceback.StackSummary) -> list[str]:
    return "".join(traceback.format_list(frames)).rstrip("\n").splitlines()[-STACK_LINES:]


@dataclass
class Part:
    """What one live rank contributes to the report."""

    rank: int
    pid: int
    host: str
    iteration: int | None
    stack: list[str]
    recent: list[dict] = field(default_factory=list)
    seqs: dict[str, list[int]] = field(default_factory=dict)  # pg -> [entered, completed]
    names: dict[str, list] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> Part:
        return Part(**json.loads(text))


@dataclass
class Waited:
    """The collective the reporting rank (or ``by``) found stuck."""

    by: int
    op: str
    pg: str
    seq: int
    seconds: float
    ranks: list[int]  # the group's ranks

    def text(self, names: dict[str, list]) -> str:
        return collective_text(self.op, self.seq, self.pg, names)


def absent(waited: Waited | None, entered: dict[int, dict[str, int]]) -> list[int]:
    """The ranks of the waited-for group that never entered its collective: their last collective on
    that group (from their part, else their last heartbeat) is before it; a rank nothing is known of
    counts as absent."""
    if waited is None:
        return []
    out = []
    for r in waited.ranks:
        if r == waited.by:
            continue
        if entered.get(r, {}).get(waited.pg, -1) < waited.seq:
            out.append(r)
    return out


def compose(
    headline: str,
    world: int,
    parts: dict[int, Part],
    silent: dict[int, str],
    waited: Waited | None,
    entered: dict[int, dict[str, int]],
    budget: str,
) -> str:
    """The report's text. ``silent``: rank -> why it has no part (stopped: no stack, ...);
    ``entered``: rank -> {pg: last collective entered} for every rank known (parts and beats)."""
    names: dict[str, list] = {}
    for p in parts.values():
        names.update(p.names)
    lines = [f"hang report ({time.strftime('%Y-%m-%d %H:%M:%S')}, {budget}):", f"  {headline}"]
    if waited is not None:
        lines.append(f"  waited for: {waited.text(names)}, by rank {waited.by} for {waited.seconds:.0f} s")
        missing = absent(waited, entered)
        if missing:
            lines.append(f"  never arrived: {_ranks(missing)}")
    for r in range(world):
        if r in parts:
            lines.extend(_rank_block(parts[r], names))
        else:
            lines.append(f"  rank {r}: {silent.get(r, 'did not answer: no stack')}")
            last = entered.get(r)
            if last:
                at = ", ".join(f"#{n} on {describe_group(pg, names)}" for pg, n in sorted(last.items()))
                lines.append(f"    last collectives entered, by its last heartbeat: {at}")
    return "\n".join(lines) + "\n"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _rank_block(p: Part, names: dict[str, list]) -> list[str]:
    at = "before its first training step" if p.iteration is None else f"after iteration {p.iteration}"
    lines = [f"  rank {p.rank} (pid {p.pid}, host {p.host}), {at}:"]
    if p.recent:
        recent = "; ".join(
            f"{collective_text(e['op'], e['seq'], e['pg'], names)}{'' if e['done'] else ' (not finished)'}"
            for e in p.recent
        )
        lines.append(f"    last collectives (flight recorder): {recent}")
    lines.append("    main thread:" if p.stack else "    main thread: no Python stack")
    lines.extend("    " + s for s in p.stack)
    return lines


def report_path(directory: str) -> str:
    return os.path.join(directory, f"hang_report_{time.strftime('%Y%m%d-%H%M%S')}.txt")


def write_report(text: str, directory: str) -> str:
    """Write the report under ``directory``; returns where, or why not."""
    path = report_path(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        return f"not written to {path}: {e.strerror or e}"
    return path
