"""Multi-process test harness: N ranks on one machine, the parallel groups built, one test body run.

On a CPU-only machine every rank is a process forked from pytest talking over gloo (forking skips
the ~2 s ``import torch`` a spawned process pays, so a 4-rank test starts in well under a second).
When CUDA GPUs are present and there are enough of them, ``backend="auto"`` runs the same body on
NCCL with one GPU per rank; on a machine with CUDA every rank is a spawned process (CUDA does not
survive a fork), which costs seconds per test. Bodies create their tensors on ``device()``.

Two ways to use it::

    def _body(ps: ParallelState, sp: bool) -> None:   # module level, so spawn can import it
        ...

    def test_something():
        run_distributed(_body, world_size=2, tp=2, kwargs={"sp": True})

    @pytest.mark.parametrize("tp", [2, 4])
    @distributed_test(world_size="tp", tp="tp")       # a str names a test parameter
    def test_other(ps: ParallelState, tp: int) -> None:
        ...

A failing rank's exception (assertion or error) is re-raised in pytest as ``DistributedTestError``
with that rank's traceback; ranks still blocked in a collective are then killed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import parallel_state

_BODY_ATTR = "_distributed_body"
_GRACE_S = 3.0  # after one rank fails, how long the others get to report before being killed


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> ``"nccl"`` with at least ``world_size`` CUDA GPUs, else ``"gloo"``."""
    if backend != "auto":
        return backend
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return "nccl" if enough_gpus and dist.is_nccl_available() else "gloo"


def device() -> torch.device:
    """The device a rank's tensors live on: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_start_method(backend: str) -> str:
    """Fork (cheap: torch is already imported) only on CPU-only machines: CUDA does not survive a
    fork, and a parent that initialised the CUDA driver is multi-threaded."""
    return "fork" if backend == "gloo" and not torch.cuda.is_available() else "spawn"


def _resolve_body(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, _BODY_ATTR, obj)  # a @distributed_test wrapper carries the real body


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    grid: tuple[int, int, int],
    body_ref: tuple[str, str],
    kwargs: dict[str, Any],
    results: Any,
    timeout_s: float,
) -> None:
    """One rank: init the default group, build the grid's groups, run the body, report, tear down."""
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        tp, pp, cp = grid
        ps = parallel_state.initialize_model_parallel(
            tp, pp, context_parallel_size=cp, distributed_timeout_minutes=None
        )
        value = _resolve_body(*body_ref)(ps, **kwargs)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list[Any], results: Any, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank to report; after the first failure give the rest ``_GRACE_S``."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue_mod.Empty:
            for rank, p in enumerate(procs):  # a rank that died without reporting (segfault, kill)
                if p.exitcode is not None and rank not in values and rank not in errors:
                    time.sleep(0.2)  # its report may still be in the pipe
                    if results.empty():
                        errors[rank] = f"rank {rank} exited with code {p.exitcode} without reporting"
            continue
        (values if ok else errors)[rank] = payload
        if errors:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return values, errors


def run_distributed(
    body: Callable[..., Any],
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    backend: str = "auto",
    timeout_s: float = 120.0,
    kwargs: dict[str, Any] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``body(ps, **kwargs)`` on ``world_size`` ranks and return each rank's return value.

    Args:
        body: a module-level function (spawned ranks import it by name) taking the rank's
            ``ParallelState`` first; its return value must pickle.
        world_size: number of ranks; ``tp``/``pp``/``cp`` are passed to ``initialize_model_parallel``
            and dp is derived.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (see ``resolve_backend``).
        timeout_s: wall-clock limit for the whole run, also the collectives' timeout.
        kwargs: keyword arguments of ``body`` (they must pickle).
        start_method: multiprocessing start method; default fork for gloo on CPU-only machines,
            spawn otherwise.

    Raises:
        DistributedTestError: a rank raised, died, or the run timed out.
    """
    __tracebackhide__ = True  # pytest shows the ranks' tracebacks, not the harness
    kwargs = kwargs or {}
    backend = resolve_backend(backend, world_size)
    ctx = mp.get_context(start_method or _default_start_method(backend))
    results = ctx.Queue()
    port = free_port()
    body_ref = (body.__module__, body.__qualname__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if (
        ctx.get_start_method() == "fork"
    ):  # pay torch.testing's lazy imports (~1 s) once here, not in every forked rank
        torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    procs = [
        ctx.Process(
            target=_rank_main,
            daemon=True,
            args=(rank, world_size, backend, port, (tp, pp, cp), body_ref, kwargs, results, timeout_s),
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        values, errors = _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=_GRACE_S)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    missing = [r for r in range(world_size) if r not in values and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(
                f"ranks {missing} did not finish (killed after the failure or the {timeout_s:.0f} s timeout)"
            )
        raise DistributedTestError(
            f"{body.__qualname__} failed on {world_size} {backend} ranks (tp={tp}, pp={pp}, cp={cp}):\n"
            + "\n".join(parts)
        )
    return [values[r] for r in range(world_size)]


def distributed_test(
    world_size: int | str,
    *,
    tp: int | str = 1,
    pp: int | str = 1,
    cp: int | str = 1,
    backend: str = "auto",
    timeout_s: float = 120.0,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorator: the test body ``fn(ps, **params)`` runs on every rank via ``run_distributed``.

    Each size may be an int or the name of one of the test's (parametrized) arguments. pytest sees
    the test's signature without ``ps``, so ``@pytest.mark.parametrize`` works as usual.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        def size(value: int | str, params: dict[str, Any]) -> int:
            return int(params[value]) if isinstance(value, str) else value

        @functools.wraps(fn)
        def wrapper(**params: Any) -> None:
            __tracebackhide__ = True
            run_distributed(
                fn,
                size(world_size, params),
                tp=size(tp, params),
                pp=size(pp, params),
                cp=size(cp, params),
                backend=backend,
                timeout_s=timeout_s,
                kwargs=params,
            )

        sig = inspect.signature(fn)
        wrapper.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # type: ignore[attr-defined]
        del wrapper.__wrapped__  # pytest must not see ``ps`` through it
        setattr(wrapper, _BODY_ATTR, fn)
        return wrapper

    return decorate
