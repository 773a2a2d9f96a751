"""Which rank of the job stopped or died: heartbeats in the job's store, process checks on this host.

Every rank's watcher thread (``initialize.ErrorChannel``) writes a heartbeat to the job's store
every ``HEARTBEAT_S``: a counter, the wall time, the last iteration the rank finished and, per
process group, the last collective it entered (PyTorch's flight recorder: ``hang_report``). A process
that is stopped (SIGSTOP, Ctrl-Z, a frozen node) stops beating, all its threads with it; a process
that died stops too, and on its own host its pid no longer names a running process. Each rank
watches

* the heartbeat of the next rank of a ring (``rank + 1 mod world``): every rank has exactly one
  watcher, so the store serves O(world) requests a second whatever the world size;
* the processes of the ranks on its own host through pidfds, which become readable the moment such
  a process ends (before torchrun, which polls its children, SIGTERMs the survivors).

Silence is measured on the watcher's own monotonic clock (when the value it reads last changed), so
the hosts' clocks need not agree; a watcher that was itself stopped (a whole job suspended and
resumed) starts its observations afresh. The same thread watches this rank's own collectives: one
pending for the budget is a hang (``tick`` returns it), reported before the backend's own timeout
fires (after start-up the groups wait a grace longer: ``job_watch.grace_s``). Nothing here runs on the training step: the loop only stores its
iteration number in an attribute (``note_iteration``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from megatron.training.hang_report import Pending, decode_seqs, encode_seqs, pending_for, sequence_numbers

HEARTBEAT_S = 1.0  # how often a rank beats (and looks at its ring neighbour and local peers)
SILENT_S = 3.0  # after a collective failed: a rank that has not beaten for this long is not running
EXPLAIN_S = 5.0  # after a collective failed: how long to look for the rank that caused it
SUSPENDED_S = 5.0  # a gap this long in a watcher's own loop means the watcher itself was stopped
SCAN_ALL_UP_TO = 64  # after a collective failed, jobs up to this size check every rank's heartbeat
LOST_RANK_CODE = 4  # every live rank's exit code when a rank stopped responding or died


@dataclass(frozen=True)
class Peer:
    """Where a rank runs, as it registered itself."""

    rank: int
    pid: int
    host: str
    machine: str  # boot id and pid namespace: ranks with the same one can look up each other's pids
    start: int  # the process's start time (/proc), so that a reused pid is not taken for the rank


@dataclass(frozen=True)
class Loss:
    """A rank the job lost: one line for the user, and the stopped process to kill, if any."""

    rank: int
    what: str  # what happened to it
    tail: str  # what happens now
    kill: Peer | None = None  # a stopped process on this host: killed so that no launcher waits for it
    reap: Peer | None = None  # an ended (or killed) process on this host: see ``wait_reaped``
    short: str = "stopped responding: no stack"  # its line in the hang report
    clause: str = ""  # the collective the others waited for it in, when known

    @property
    def message(self) -> str:
        return f"{self.what}; {self.clause + '; ' if self.clause else ''}{self.tail}"

    def waited(self, clause: str) -> Loss:
        return replace(self, clause=clause)


@dataclass(frozen=True)
class ProcState:
    state: str  # proc(5) letter: R S D running or sleeping, T stopped, t traced, Z X ended
    start: int  # start time in clock ticks since boot
    exit_code: int  # waitpid status of an ended process (Z) not yet reaped by its parent, else 0


def _proc_state(pid: int) -> ProcState | None:
    """``pid``'s entry in /proc; None when there is none (the process ended and was reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 3, 22 and 52 of proc(5), counted from 1 with field 2 (the name) split off.
    return ProcState(fields[0], int(fields[19]), int(fields[49]) if len(fields) > 49 else 0)


def _is_running(peer: Peer, state: ProcState | None) -> bool:
    return state is not None and state.start == peer.start and state.state not in "ZX"


def _how_it_ended(state: ProcState | None) -> str:
    if state is None or state.state not in "ZX":
        return "is gone (its process ended)"
    sig = state.exit_code & 0x7F
    if sig == signal.SIGKILL:
        return "was killed by SIGKILL (as the kernel's out-of-memory killer does: see dmesg)"
    if sig:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        return f"was killed by {name}"
    return f"exited with code {state.exit_code >> 8} without finishing (its own output may say why)"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # how launchers stop a whole job


def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # no /proc: never taken to share a host with anyone
    return f"{boot}/{pid_ns}"


def _format_iteration(iteration: str) -> str:
    return "before its first training step" if iteration == "None" else f"at iteration {iteration}"


class PeerWatch:
    """This rank's heartbeat and its view of the others. ``store`` is the ErrorChannel's own client;
    ``timeout_s`` is --distributed-timeout-minutes in seconds; ``local_world`` the ranks on this host
    when the launcher says (LOCAL_WORLD_SIZE), else None."""

    def __init__(
        self, store: dist.Store, rank: int, world: int, timeout_s: float, local_world: int | None
    ) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.budget = f"--distributed-timeout-minutes {timeout_s / 60:g}"  # the flag that set timeout_s
        self.local_world = local_world
        self.iteration: int | None = None  # the last iteration this rank finished (note_iteration)
        self.records = False  # the flight recorder records this rank's collectives (``hang_report``)
        self.seqs: dict[str, tuple[int, int]] = {}  # pg -> (last entered, last completed), each beat
        self.pending: dict[str, Pending] = {}  # pg -> its oldest collective not finished
        self.machine = _machine()
        self._count = 0
        self._peers: dict[int, Peer] = {}
        self._watched = (rank + 1) % world if world > 1 else None
        self._seen: tuple[str | None, float] = (None, time.monotonic())  # neighbour's beat, when it changed
        self._last_round = time.monotonic()
        self._local_known = 0  # entries of this host's list read so far
        self._local: list[int] = []  # the other ranks on this host
        self._pidfds: dict[int, int] = {}  # fd -> rank, until that rank's process ends
        self._poll = select.poll()
        self._lock = threading.Lock()  # _open_local_peers: the watcher thread and ``explain``

    # -- this rank ------------------------------------------------------------------------------
    def register(self) -> None:
        pid = os.getpid()
        state = _proc_state(pid)
        me = {
            "pid": pid,
            "host": socket.gethostname(),
            "machine": self.machine,
            "start": state.start if state else 0,
        }
        self.store.set(f"who/{self.rank}", json.dumps(me))
        if self.machine:
            index = self.store.add(f"local/{self.machine}/n", 1) - 1
            self.store.set(f"local/{self.machine}/{index}", str(self.rank))
        self.beat()

    def set_budget(self, seconds: float, flag: str) -> None:
        """From now on a rank silent (or a collective pending) this long is lost (after start-up)."""
        self.timeout_s, self.budget = seconds, flag

    def beat(self) -> None:
        self._count += 1
        if self.records:
            self.seqs = sequence_numbers()
        seqs = encode_seqs(self.seqs)
        self.store.set(f"beat/{self.rank}", f"{self._count} {time.time():.3f} {self.iteration} {seqs}")

    def mark(self, what: str) -> None:
        """``done``: this rank ends normally; ``raising``: it is about to print an exception of its
        own. Either way its end is no loss for its watchers to report."""
        self.store.set(f"{what}/{self.rank}", "1")

    # -- the watcher thread: one round ----------------------------------------------------------
    def tick(self, closed: threading.Event) -> Loss | Pending | None:
        """Beat, look at this rank's own collectives and the ring neighbour, and wait up to
        HEARTBEAT_S for a local peer to end. A collective pending too long is returned as such."""
        now = time.monotonic()
        if now - self._last_round > SUSPENDED_S:  # this process was stopped itself: nobody is late yet
            self._seen = (self._seen[0], now)
            self.pending.clear()
        self.beat()
        stuck = pending_for(self.seqs, self.pending, now)
        if stuck is not None and now - stuck.since >= self.timeout_s:
            return stuck
        with self._lock:
            self._open_local_peers()
        loss = self._check_neighbour(now)
        if loss is None:
            loss = self._wait_local(HEARTBEAT_S, closed)
        self._last_round = time.monotonic()
        return loss

    def _check_neighbour(self, now: float) -> Loss | None:
        r = self._watched
        if r is None:
            return None
        value = self._beat(r)
        if value != self._seen[0]:
            self._seen = (value, now)
            return None
        silent = now - self._seen[1]
        if silent <= self.timeout_s or self._excused(r):
            return None
        return self.lost(r, silent)

    def _open_local_peers(self) -> None:
        """Learn the ranks that registered on this host since the last look; a pidfd for each."""
        if not self.machine or (self.local_world is not None and self._local_known >= self.local_world):
            return
        count = self.store.add(f"local/{self.machine}/n", 0)
        for index in range(self._local_known, count):
            r = int(self.store.get(f"local/{self.machine}/{index}"))
            self._local_known = index + 1
            if r == self.rank:
                continue
            self._local.append(r)
            try:
                fd = os.pidfd_open(self.peer(r).pid)  # Linux 5.3; without it ``explain`` still checks /proc
            except (AttributeError, OSError):
                continue
            self._pidfds[fd] = r
            self._poll.register(fd, select.POLLIN)

    def _wait_local(self, seconds: float, closed: threading.Event) -> Loss | None:
        if not self._pidfds:
            closed.wait(seconds)
            return None
        for fd, _ in self._poll.poll(seconds * 1000):
            r = self._pidfds.pop(fd)
            self._poll.unregister(fd)
            os.close(fd)
            state = _proc_state(self.peer(r).pid)  # read at once: the launcher reaps it within 0.1 s
            if closed.is_set() or self._excused(r):
                continue
            if state is not None and state.state in "ZX" and state.exit_code & 0x7F in STOP_SIGNALS:
                continue  # stopped by a launcher's or a user's signal, as every rank is about to be
            return self.lost(r, None, state)
        return None

    # -- the main thread, after a collective failed ---------------------------------------------
    def explain(self, failed: Callable[[], bool]) -> Loss | None:
        """Look for a rank that died, is stopped or went silent, for up to EXPLAIN_S; None when there
        is none or ``failed()`` says a peer has reported the job's end (then the caller follows it)."""
        with self._lock:
            self._open_local_peers()
        local = list(self._local)
        near = {r for r in (self._watched, *local) if r is not None}
        candidates = [
            r for r in (range(self.world) if self.world <= SCAN_ALL_UP_TO else sorted(near)) if r != self.rank
        ]
        first = {r: self._beat(r) for r in candidates}
        start = time.monotonic()
        while not failed():
            for r in local:
                state = _proc_state(self.peer(r).pid)
                stopped = state is not None and state.state == "T"
                if (stopped or not _is_running(self.peer(r), state)) and not self._excused(r):
                    return self.lost(r, None, state)
            waited = time.monotonic() - start
            if waited >= SILENT_S:
                for r in candidates:
                    if self._beat(r) == first[r] and not self._excused(r):
                        return self.lost(r, None)
            if waited >= EXPLAIN_S:
                return None
            time.sleep(0.25)
        return None

    def running(self, r: int) -> bool:
        """Rank ``r`` runs, at a glance: on this host its process is not stopped nor ended; elsewhere
        its last heartbeat is under SILENT_S old by this host's clock (``explain`` looks longer)."""
        peer = self.peer(r)
        if self.machine and peer.machine == self.machine:
            state = _proc_state(peer.pid)
            return _is_running(peer, state) and state is not None and state.state not in "Tt"
        beat = self._beat(r)
        return beat is not None and time.time() - float(beat.split()[1]) < SILENT_S

    # -- what is known of a rank ----------------------------------------------------------------
    def peer(self, r: int) -> Peer:
        if r not in self._peers:
            d = json.loads(self.store.get(f"who/{r}"))
            self._peers[r] = Peer(r, int(d["pid"]), d["host"], d["machine"], int(d["start"]))
        return self._peers[r]

    def _beat(self, r: int) -> str | None:
        key = f"beat/{r}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def entered(self, r: int) -> dict[str, int]:
        """Rank ``r``'s last collective entered per process group, by its last heartbeat."""
        beat = self._beat(r)
        fields = beat.split() if beat else []
        return decode_seqs(fields[3]) if len(fields) > 3 else {}

    def _excused(self, r: int) -> bool:
        return self.store.check([f"done/{r}"]) or self.store.check([f"raising/{r}"])

    def lost(self, r: int, silent: float | None, state: ProcState | None = None) -> Loss:
        """The line for rank ``r``, from its registration, its last heartbeat and (on this host) its
        process. ``silent``: how long the watcher saw no beat (None: found by a process check)."""
        peer = self.peer(r)
        beat = self._beat(r)
        _, wall, iteration = beat.split()[:3] if beat else ("0", "0", "None")
        at = _format_iteration(iteration)
        ago = max(time.time() - float(wall), 0.0) if beat else 0.0  # its last beat, by this host's clock
        who = f"rank {r} (pid {peer.pid}, host {peer.host})"
        rest = f"the job stops, every other rank with exit code {LOST_RANK_CODE}"
        stalled = f"{who} stopped responding {silent if silent is not None else ago:.0f} s ago, {at}"
        waits = f"no rank waits longer than {self.budget}: {rest}"
        if not (self.machine and peer.machine == self.machine):
            return Loss(r, stalled, waits)
        state = state if state is not None else _proc_state(peer.pid)
        if state is None or not _is_running(peer, state):
            how = _how_it_ended(state)
            return Loss(
                r,
                f"{who} {how}; its last heartbeat, {ago:.1f} s before, was {at}",
                rest,
                reap=peer,
                short=f"{how.split(' (')[0]}: no stack",
            )
        if state.state == "T":
            return Loss(
                r,
                f"{stalled}: its process is stopped (SIGSTOP or Ctrl-Z), and is killed",
                waits,
                kill=peer,
                reap=peer,
                short="stopped (SIGSTOP or Ctrl-Z): no stack",
            )
        if state.state == "t":
            return Loss(
                r, f"{stalled} (stopped in a debugger)", waits, short="stopped in a debugger: no stack"
            )
        return Loss(r, stalled, waits)


def kill_stopped(loss: Loss) -> None:
    """SIGKILL the stopped process of ``loss`` if it is still that process and still stopped: a
    stopped process keeps a launcher's SIGTERM pending, and the launcher waits for it (torchrun
    30 s, srun without --kill-on-bad-exit for ever)."""
    peer = loss.kill
    if peer is None:
        return
    state = _proc_state(peer.pid)
    if state is not None and state.state == "T" and state.start == peer.start:
        try:
            os.kill(peer.pid, signal.SIGKILL)
        except OSError:
            pass


def wait_reaped(loss: Loss | None, seconds: float = 5.0) -> None:
    """Wait until the launcher has reaped the lost process on this host (it no longer has an entry
    in /proc), so that the launcher sees its end before any survivor's: torchrun names the first
    failure it observes as the root cause, and polls its children every 0.1 s."""
    peer = loss.reap if loss is not None else None
    if peer is None:
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = _proc_state(peer.pid)
        if state is None or state.start != peer.start:
            return
        time.sleep(0.02)
