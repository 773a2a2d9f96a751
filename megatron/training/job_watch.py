"""The error channel's hang report and budgets (``initialize.ErrorChannel``): the flags that shape
them (``JobWatch``), the budget after start-up, the line that names a hang, and each rank's part of
the report in the job's store and its assembly by the first rank to report (``hang_report``)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.training import hang_report
from megatron.training.global_vars import app_state
from megatron.training.hang_report import Part, Pending, Waited
from megatron.training.peers import LOST_RANK_CODE, Loss, PeerWatch
from megatron.training.stragglers import StragglerLog

if TYPE_CHECKING:
    from megatron.training.run_config import RunConfig


GRACE_S = 10.0  # at most this much (30 % of the budget) between the watch and the groups' timeout


@dataclass
class JobWatch:
    """What the error channel does beyond naming a lost rank, from the run's flags
    (``initialize.configure_job_watch``)."""

    seconds_after_init: int | None = None  # --distributed-timeout-seconds-after-init
    dump_on_timeout: bool = True  # the hang report (stacks, flight recorder); off: the one line only
    report_dir: str = "."  # where the hang report's file goes
    straggler: StragglerLog | None = None  # --log-straggler
    after_init: bool = False  # the budget after start-up is in force


def configure_job_watch(cfg: RunConfig) -> None:
    """After ``initialize_distributed``: the hang report's directory (--save, else
    --tensorboard-dir, else the working directory) and flags, --log-straggler. Nothing in a job of
    one process."""
    channel = app_state().channel
    if channel is None:
        return
    t, lg = cfg.training, cfg.logger
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    channel.job = JobWatch(
        seconds_after_init=t.distributed_timeout_seconds_after_init,
        dump_on_timeout=t.flight_recorder_dump_on_timeout,
        report_dir=cfg.checkpoint.save or lg.tensorboard_dir or os.getcwd(),
        straggler=StragglerLog(lg.log_interval, device or torch.device("cpu")) if lg.log_straggler else None,
    )


def after_step(watch: JobWatch, peers: PeerWatch | None, iteration: int) -> None:
    """``note_iteration``'s part: the budget after the first iteration, --log-straggler's line."""
    if not watch.after_init:
        after_init(watch, peers)
    if watch.straggler is not None:
        line = watch.straggler.step(iteration)
        if line:
            print(line, flush=True)


def is_timeout(error: BaseException) -> bool:
    """A collective's own timeout (gloo: "Timed out waiting 10000ms", NCCL: "Watchdog caught
    collective operation timeout"), not a closed connection."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def grace_s(seconds: float) -> float:
    """How much longer than the watch's budget a process group waits after start-up: the watch
    stops the job at the budget, with its report, before the backend's own timeout fires (gloo
    raises, NCCL's watchdog aborts the process)."""
    return min(GRACE_S, 0.3 * seconds)


def after_init(watch: JobWatch, peers: PeerWatch | None) -> None:
    """The first iteration is done: the heartbeat and collective watch wait
    --distributed-timeout-seconds-after-init from now on, every process group that plus
    ``grace_s`` (Megatron-LM applies the flag at the same point; each rank sets its own groups'
    timeout, so no barrier is needed)."""
    watch.after_init = True
    seconds = watch.seconds_after_init
    if seconds is None:
        return
    c10d = dist.distributed_c10d
    for group in list(getattr(c10d._world, "pg_names", {})):  # every group made so far, the default too
        try:
            c10d._set_pg_timeout(timedelta(seconds=seconds + grace_s(seconds)), group)
        except (ValueError, AssertionError, RuntimeError):  # a group this rank is not in
            continue
    if peers is not None:
        peers.set_budget(float(seconds), f"--distributed-timeout-seconds-after-init {seconds}")


def find_lost(peers: PeerWatch, waited: Waited | None, failed: Callable[[], bool]) -> Loss | None:
    """The lost rank behind a hang, if any: none to look for when every rank that never arrived
    runs (a glance at each); else ``PeerWatch.explain`` looks (up to EXPLAIN_S)."""
    entered = {r: peers.entered(r) for r in (waited.ranks if waited else [])}
    absent = hang_report.absent(waited, entered)
    if absent and all(peers.running(r) for r in absent):
        return None
    return peers.explain(failed)


def hang_message(peers: PeerWatch, waited: Waited | None, names: dict[str, list]) -> str:
    """The one line of a hang no lost rank explains: who never arrived at which collective."""
    tail = (
        f"no rank waits longer than {peers.budget}: the job stops, every rank with exit code {LOST_RANK_CODE}"
    )
    if waited is None:
        return f"rank {peers.rank}'s collective timed out and no rank is lost (see the hang report); {tail}"
    absent = hang_report.absent(waited, {r: peers.entered(r) for r in waited.ranks})
    what = f"{waited.text(names)}, which rank {waited.by} waited {waited.seconds:.0f} s in"
    if not absent:
        return f"every rank entered {what}, and it did not finish (see the hang report's stacks); {tail}"
    who = ", ".join(_who(peers, r) for r in absent)
    return f"{who} never arrived at {what} (its stack is in the hang report); {tail}"


def _who(peers: PeerWatch, r: int) -> str:
    try:
        peer = peers.peer(r)
    except Exception:  # never registered
        return f"rank {r}"
    return f"rank {r} (pid {peer.pid}, host {peer.host})"


def waited_for(peers: PeerWatch, stuck: Pending | None, names: dict[str, list]) -> Waited | None:
    """The collective this rank waits in: ``stuck``, else the oldest one still pending."""
    recorded = hang_report.entries()
    if stuck is None:
        stuck = min(peers.pending.values(), key=lambda p: p.since, default=None)
    if stuck is None:  # the main thread's collective timed out before the watcher saw it pending
        last = next((e for e in reversed(recorded) if not e["p2p"]), None)  # the one that timed out
        if last is None:
            return None
        stuck = Pending(last["pg"], last["seq"], time.monotonic() - peers.timeout_s)
    ranks = hang_report.lookup_group(stuck.pg, names)[1]
    op = hang_report.op_of(recorded, stuck.pg, stuck.seq)
    seconds = time.monotonic() - stuck.since
    return Waited(peers.rank, op, stuck.pg, stuck.seq, seconds, list(ranks))


def publish_part(
    store: dist.Store, peers: PeerWatch, main_stack: list[str] | None, names: dict[str, list]
) -> None:
    """This rank's part of the hang report: where its main thread is, its recent collectives.
    ``main_stack``: the main thread's own, taken from a collective's error (the main thread is the
    one publishing); else the watcher thread reads it."""
    in_main = threading.current_thread() is threading.main_thread()
    stack = main_stack or ([] if in_main else hang_report.main_thread_stack())
    part = Part(
        rank=peers.rank,
        pid=os.getpid(),
        host=socket.gethostname(),
        iteration=peers.iteration,
        stack=stack,
        recent=hang_report.entries()[-hang_report.RECENT :],
        seqs={pg: list(v) for pg, v in hang_report.sequence_numbers().items()},
        names=names,
    )
    store.set(f"part/{peers.rank}", part.to_json())


def print_report(
    store: dist.Store, peers: PeerWatch, world: int, message: str, waited: Waited | None, directory: str
) -> None:
    """The first reporter, after the barrier (every live rank's part is in): print the report once
    and write it under ``directory``. A rank without a part is described by why it was lost
    (``why/<rank>``) and its last heartbeat."""
    parts, silent, entered = {}, {}, {}
    for r in range(world):
        if store.check([f"part/{r}"]):
            parts[r] = Part.from_json(store.get(f"part/{r}"))
            entered[r] = {pg: v[0] for pg, v in parts[r].seqs.items()}
            continue
        if store.check([f"why/{r}"]):
            silent[r] = store.get(f"why/{r}").decode()
        entered[r] = peers.entered(r)
    text = hang_report.compose(message, world, parts, silent, waited, entered, peers.budget)
    where = hang_report.write_report(text, directory)
    print(text + f"  (the report is also in {where})", file=sys.stderr, flush=True)
