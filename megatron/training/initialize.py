"""Process-group set-up, device choice, seeding, and stopping the whole job on an error."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron.training import hang_report, job_watch
from megatron.training.global_vars import app_state
from megatron.training.hang_report import Pending, Waited
from megatron.training.job_watch import JobWatch
from megatron.training.job_watch import configure_job_watch as configure_job_watch
from megatron.training.peers import LOST_RANK_CODE, Loss, PeerWatch, kill_stopped, wait_reaped

if TYPE_CHECKING:
    pass


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def initialize_distributed(
    backend: str = "auto",
    timeout_minutes: int = 10,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    hierarchical_cp: list[int] | None = None,
    ep: int = 1,
    etp: int | None = None,
) -> tuple[torch.device, ParallelState]:
    """Join the process group torchrun (or srun) describes, or run alone.

    Without CUDA the backend is gloo on the CPU; with CUDA, NCCL on ``cuda:LOCAL_RANK``. A single
    process started with plain ``python`` gets a one-rank group too, so every code path is the same.
    Every process group waits ``timeout_minutes`` for a collective, and so long for a silent rank
    (see ``peers``) before the job stops with exit code 4.
    """
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    use_cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ConfigError(
            "distributed_backend 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on the CPU",
            params=("distributed_backend",),
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"  # torchrun (joins its store) or srun with the variables exported
        elif world == 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"  # plain `python pretrain_gpt.py`
        else:
            raise ConfigError(
                f"{world} processes but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun, "
                "or export MASTER_ADDR=<first node> MASTER_PORT=29500 in the srun script"
            )
        if world > 1:
            hang_report.enable_flight_recorder()
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
        )
        if world > 1 and init_method == "env://":
            local_world = _env_int("LOCAL_WORLD_SIZE", default=0) or None
            _start_error_channel(world, rank, 60.0 * timeout_minutes, local_world)
    state = initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=hierarchical_cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )  # the trainer uses none
    channel = app_state().channel
    if channel is not None:
        channel.group_names = hang_report.group_names(state.groups, state.group_ranks)
    return device, state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seeds(seed: int, pp_rank: int = 0) -> None:
    """Python, NumPy and torch (CPU and CUDA) seeds: ``seed + 100 * pp_rank`` as in Megatron."""
    s = seed + 100 * pp_rank
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)


def destroy() -> None:
    """Close this rank's error channel, forget the parallel layout, end the process group."""
    state = app_state()
    if state.channel is not None:
        state.channel.close()
        state.channel = None
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# One error, one line, every rank out with the same code.
#
# A rank that raises a user error must not simply exit: its peers may be blocked in a collective
# with it (gloo then dumps "Connection reset" tracebacks, NCCL hangs until its timeout), and torchrun
# SIGTERMs the others the moment one rank exits. So the failing rank records the error in the job's
# TCPStore, every other rank's watcher thread sees it within POLL_S, all meet at a store barrier,
# ignore SIGTERM from then on and leave with the error's exit code, the failing ranks first (so that
# torchrun names one of them as the root cause). The store is a connection of its own to the job's
# store server (under torchrun the agent's, which outlives every rank): the process group's client
# can be held by a blocking wait (NCCL's rendezvous) that would starve the watcher.
#
# A rank that stops (SIGSTOP) or dies (kill -9, a crash) cannot report itself: its peers do, from
# its heartbeat and, on its host, its process (megatron.training.peers). The first rank to find it
# prints one line naming it and every live rank exits LOST_RANK_CODE (4); the barrier counts the
# lost ranks as arrived. A collective that waits its budget (``PeerWatch.tick``) or raises its
# timeout is a hang: the rank names the ranks of the group that never entered it, lost or not, and
# the job stops the same way. Either way every live rank puts its part of the hang report (its main
# thread's stack, its recent collectives) in the store before the barrier, and the first rank to
# report prints the report after it (``hang_report``).

POLL_S = 1.0  # how often a rank looks for a peer's error
JOIN_TIMEOUT_S = 60.0  # how long the ranks that know wait for the others at the barrier


class ErrorChannel:
    """The store keys through which the ranks of one job (one torchrun attempt) stop together."""

    def __init__(self, store: dist.Store, world: int, peers: PeerWatch | None = None) -> None:
        self.store, self.world, self.peers = store, world, peers
        self._lock = threading.Lock()  # one exit per process: the main thread's or the watcher's
        self._closed = threading.Event()
        self.stopping = False  # set once this process is on its way out through ``stop``
        self.job = JobWatch()  # ``configure_job_watch``
        self.group_names: dict[str, list] = {}  # process group name -> [label, ranks]
        self.main_stack: list[str] | None = None  # the main thread's, with a collective's error in hand
        self._hang = threading.Event()  # one thread handles a hang; the other waits for the exit

    def watch(self) -> None:
        """Poll for a peer's error in a daemon thread; on one, leave with its code (see ``stop``).
        With ``peers``, the same thread beats and watches for a lost rank (``lose``)."""
        threading.Thread(target=self._watch, name="megatron-error-watch", daemon=True).start()

    def close(self) -> None:
        """This rank ends normally: its watchers must not take its exit for a loss."""
        if self.peers is not None and not self._closed.is_set():
            try:
                self.peers.mark("done")
            except Exception:  # the store server is gone: nobody is left to watch
                pass
        self._closed.set()

    def _watch(self) -> None:
        found: Loss | Pending | None = None
        try:
            while not self.store.check(["failed"]):
                if self.peers is None:
                    if self._closed.wait(POLL_S):
                        return
                    continue
                found = self.peers.tick(self._closed)
                if self._closed.is_set():
                    return
                if found is not None and not self.store.check(["failed"]):
                    break
                found = None
        except Exception:  # the store server is gone: the job is ending anyway
            return
        if isinstance(found, Pending):
            self.hang(found)
        elif found is not None:
            self.lose(found)
        if not self._closed.is_set():
            self.stop(None, 0)

    def lose(self, loss: Loss, stuck: Pending | None = None) -> None:
        """A rank is lost: kill it if it is a stopped process on this host, report it (with the
        collective this rank waits for it in, if any), leave with LOST_RANK_CODE. Returns at once
        when this process is already leaving (for another reason)."""
        if self.stopping:
            return
        _ignore_sigterm()  # the launcher SIGTERMs the survivors of a rank that died
        kill_stopped(loss)  # first, so that the launcher names the lost rank as the first to fail
        waited = self._waited(stuck)
        if waited is not None:
            loss = loss.waited(
                f"rank {waited.by} waited {waited.seconds:.0f} s for it in {waited.text(self.group_names)}"
            )
        self.stop(loss.message, LOST_RANK_CODE, loss=loss, waited=waited)

    def hang(self, stuck: Pending | None) -> None:
        """A collective of this rank waited its budget (``stuck``; None: the main thread's collective
        raised its timeout). A lost rank is reported as such (``lose``); else the ranks of the group
        that never entered the collective are named, and the job stops with LOST_RANK_CODE."""
        if self.stopping or self._hang.is_set():
            return
        self._hang.set()
        _ignore_sigterm()
        assert self.peers is not None
        waited = self._waited(stuck)
        try:
            loss = job_watch.find_lost(self.peers, waited, lambda: self.store.check(["failed"]))
            if self.store.check(["failed"]):
                self.stop(None, 0)
        except Exception:  # the store server is gone: report what this rank knows
            loss = None
        if loss is not None:
            self.lose(loss, stuck)
        self.stop(self._hang_message(waited), LOST_RANK_CODE, waited=waited)

    def _hang_message(self, waited: Waited | None) -> str:
        assert self.peers is not None
        return job_watch.hang_message(self.peers, waited, self.group_names)

    def _waited(self, stuck: Pending | None) -> Waited | None:
        """The collective this rank waits in: ``stuck``, else the oldest one still pending."""
        return None if self.peers is None else job_watch.waited_for(self.peers, stuck, self.group_names)

    def explain(self, error: BaseException) -> None:
        """Main thread, with ``error`` in hand. A collective that failed or timed out: if a rank was
        lost (or a peer already reported the job's end), leave as ``lose`` (or ``stop``) does; else
        return, and the error keeps its traceback."""
        if (
            self.peers is None
            or not _is_communication_error(error)
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        self.main_stack = hang_report.exception_stack(error)
        if self._hang.is_set():  # the watcher found the hang first and is on its way out
            self._wait_for_exit()
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as in ``lose``: while looking for the lost rank
        try:
            loss = self.peers.explain(lambda: self.store.check(["failed"]))
            if loss is not None:
                self.lose(loss)
            if self.store.check(["failed"]):
                self.stop(None, 0)
            if job_watch.is_timeout(error):
                self.hang(None)
                self._wait_for_exit()
            self.peers.mark("raising")
        except Exception:  # the store server is gone: nothing to learn from it
            pass
        # Put the handler back only while no thread is on its way out: the watcher may have found
        # the lost rank meanwhile and ignores SIGTERM until its os._exit (``stop`` holds the lock).
        if previous is not None and self._lock.acquire(blocking=False):
            try:
                if not self.stopping:
                    signal.signal(signal.SIGTERM, previous)
            finally:
                self._lock.release()

    def _wait_for_exit(self) -> None:
        """Another thread of this process is leaving through ``stop``: wait for its os._exit."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:  # held until os._exit
            pass

    def stop(
        self, message: str | None, code: int, loss: Loss | None = None, waited: Waited | None = None
    ) -> NoReturn:
        """Exit this process once every rank knows. ``message`` is this rank's own error (main
        thread): the first rank to report one prints it and sets the job's exit code (``code``).
        ``None`` (the watcher): a peer failed; leave quietly with the job's code. ``loss``: the rank
        the message is about, which is not waited for; ``waited``: the collective it hung in. A lost
        rank or a hang (``code`` LOST_RANK_CODE) asks every rank for its part of the hang report."""
        with self._lock:
            self.stopping = True
            reported = first = False
            try:
                _ignore_sigterm()
                if loss is not None:
                    self._mark_lost(loss)
                report = code == LOST_RANK_CODE and self.job.dump_on_timeout and self.peers is not None
                if message is not None:
                    first = self._report(code, report)
                    reported = True
                    if first:
                        _print_error(message)
                code = int(self.store.get("code"))
                report = report or self.store.check(["report"])
                if report:
                    self._publish_part()
                self._join()
                if first and report and message is not None:
                    self._print_report(message, waited)
                wait_reaped(loss)
                self._leave_in_order(reporter=message is not None)
            except Exception:  # a broken store, or a rank that never came: leave all the same
                if message is not None and not reported:
                    _print_error(message)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _report(self, code: int, report: bool = False) -> bool:
        """Record this rank's error; True for the first rank to report (the one that prints).
        ``report``: every rank is to publish its part of the hang report."""
        first = self.store.add("reporters", 1) == 1
        if first:
            self.store.set("code", str(code))
            if report:
                self.store.set("report", "1")
        self.store.set("failed", "1")
        return first

    def _publish_part(self) -> None:
        assert self.peers is not None
        job_watch.publish_part(self.store, self.peers, self.main_stack, self.group_names)

    def _print_report(self, message: str, waited: Waited | None) -> None:
        assert self.peers is not None
        job_watch.print_report(self.store, self.peers, self.world, message, waited, self.job.report_dir)

    def _join(self) -> None:
        # Each rank that joins reads the lost count after adding itself, each rank that marks a loss
        # reads the joined count after adding it: whichever adds last sees both and opens the barrier.
        if self.store.add("joined", 1) + self.store.add("num_lost", 0) >= self.world:
            self.store.set("all_joined", "1")
        self.store.wait(["all_joined"], timedelta(seconds=JOIN_TIMEOUT_S))

    def _mark_lost(self, loss: Loss) -> None:
        rank = loss.rank
        self.store.set(f"why/{rank}", loss.short)
        if self.store.add(f"lost/{rank}", 1) == 1:
            if self.store.add("num_lost", 1) + self.store.add("joined", 0) >= self.world:
                self.store.set("all_joined", "1")

    def _leave_in_order(self, reporter: bool) -> None:
        """The ranks that raised the error leave first, the others a moment after them."""
        if reporter:
            self.store.add("left", 1)
            return
        reporters = self.store.add("reporters", 0)
        deadline = time.monotonic() + 5.0
        while self.store.add("left", 0) < reporters and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a reporter exits right after counting itself; torchrun polls every 0.1 s


def _ignore_sigterm() -> None:
    """Ignore SIGTERM from any thread (``signal.signal`` works in the main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    setsig = ctypes.pythonapi.PyOS_setsig  # CPython's C API: sigaction from any thread
    setsig.argtypes, setsig.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    setsig(signal.SIGTERM, signal.SIG_IGN.value)


def wait_if_leaving() -> None:
    """Called by the main thread with an exception in hand: when this rank is already leaving for
    a peer's error, the exception is its consequence (no rank leaves before every rank has joined,
    and a peer that left closes its connections): wait for the exit instead of reporting it. When
    the exception is a collective that failed with a lost rank, report that rank and leave
    (``ErrorChannel.explain``). Otherwise return: the exception keeps its traceback."""
    channel = app_state().channel
    if channel is None:
        return
    if not channel.stopping:
        error = sys.exc_info()[1]
        if error is not None:
            channel.explain(error)
    if channel.stopping:
        with channel._lock:  # held until os._exit
            pass


def note_iteration(iteration: int) -> None:
    """The last iteration the training loop finished, for this rank's heartbeat (a plain attribute
    store: nothing waits for the device). After the first, the budget after start-up takes over;
    with --log-straggler, at log intervals, the ranks' times are gathered (``stragglers``)."""
    channel = app_state().channel
    if channel is None:
        return
    if channel.peers is not None:
        channel.peers.iteration = iteration
    job_watch.after_step(channel.job, channel.peers, iteration)


def _is_communication_error(error: BaseException) -> bool:
    """A collective or store operation that failed: what a lost rank makes its peers raise (gloo
    raises a plain RuntimeError naming its transport, NCCL a DistBackendError)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(
        error, RuntimeError
    ) and any(  # gloo's async work says "Application timeout caused pair closure"
        s in text
        for s in (
            "gloo",
            "nccl",
            "connection reset",
            "connection closed",
            "timed out",
            "timeout",
            "pair closure",
        )
    )


def _print_error(message: str) -> None:
    print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)


def _store_client(prefix: str) -> dist.Store:
    """A new connection to the job's store server (MASTER_ADDR:MASTER_PORT), keys under ``prefix``."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        wait_for_workers=False,
    )
    return dist.PrefixStore(prefix, store)


def _channel_prefix() -> str:
    """Per torchrun run and attempt: the agent's store outlives restarts (--max-restarts)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"megatron/errors/{run_id}/{attempt}"


def _start_error_channel(world: int, rank: int, timeout_s: float, local_world: int | None) -> None:
    store = _store_client(_channel_prefix())
    peers = PeerWatch(store, rank, world, timeout_s, local_world)
    peers.records = hang_report.recording()
    peers.register()
    channel = ErrorChannel(store, world, peers)
    app_state().channel = channel
    channel.watch()


def stop_job(message: str, code: int) -> int:
    """Report an error that stops the run: ``pretrain_gpt.py: error: <message>`` once per job.

    In a job of several processes every rank exits with ``code`` (this function does not return)
    once all have learned of it; a single process prints, tears down and returns ``code``. Before
    the process groups exist, the ranks meet in torchrun's store (every rank raises the same error
    from the same flags); without torchrun, rank 0 alone prints.
    """
    channel = app_state().channel
    if channel is not None:
        channel.stop(message, code)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    if world > 1 and not dist.is_initialized() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:
            channel = ErrorChannel(_store_client(_channel_prefix()), world)
        except Exception:  # no store to meet in: fall through to rank 0 printing
            pass
        else:
            channel.stop(message, code)
    if rank == 0 or dist.is_initialized():
        _print_error(message)
    destroy()
    return code
