"""Several pretrain_gpt.py runs one after the other in the same torchrun processes.

    torchrun --standalone --nproc-per-node N tests/functional/multi_run.py <argv 1> --next-run <argv 2> ...

Each run is ``megatron.training.cli.run(argv)``, as pretrain_gpt.py calls it, and must start as a
separate launch would, so that a test pays for the interpreters' start-up once:

- every run gets a store server of its own (hosted by rank 0, its port published through torchrun's
  store; ``MASTER_PORT`` points at it for the run): a process group or error channel made again on
  an earlier run's store would meet that run's keys (a default group's name repeats after it is
  destroyed, and gloo's rendezvous can then hang);
- ``cli.run`` ends each run with the library's teardown (``destroy_model_parallel``, the default
  process group destroyed), and the process's runtime state is replaced by a fresh one;
- the previous run's tensors are freed and, on a GPU, the allocator's cache and peak statistics reset
  (a run's peak memory is its own);
- the ranks meet before each run, and rank 0 prints ``multi_run.py: run <k> of <n>`` on stdout and
  stderr in between, so that ``launch.torchrun_many`` can cut the output into runs.

The first run that fails ends the launch with its exit code (a user error in a job of several
processes already ends every rank from ``cli.run``). Seeds, data order and losses are those of
separate launches (tests/functional/test_multi_run.py checks it bit for bit).
"""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Started as a script, like pretrain_gpt.py at the repository's root, which imports from there.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron.core.runtime import reset_runtime  # noqa: E402
from megatron.training.cli import run  # noqa: E402

SEPARATOR = "--next-run"
MARKER = "multi_run.py: run "
STORE_TIMEOUT = timedelta(minutes=10)  # how long a rank waits for its peers between runs


def split_runs(argv: list[str]) -> list[list[str]]:
    """``a b --next-run c`` -> ``[[a, b], [c]]``."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def _agent_store() -> dist.Store:
    """A connection to torchrun's store, under a prefix of this launch's own."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=STORE_TIMEOUT,
        wait_for_workers=False,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"multi_run/{run_id}/{attempt}", store)


def _meet(store: dist.Store, key: str, world: int) -> None:
    """Return once every rank has arrived at ``key`` (the last to arrive opens it)."""
    if int(store.add(key, 1)) == world:
        store.set(f"{key}/open", "1")
    store.wait([f"{key}/open"], STORE_TIMEOUT)


def _run_store(store: dist.Store, index: int, rank: int, servers: list[dist.TCPStore]) -> int:
    """The port of run ``index``'s store server: rank 0 starts it (kept in ``servers`` until the
    launch ends, so that no rank's late reads find it gone) and publishes the port."""
    if rank == 0:
        server = dist.TCPStore(
            os.environ["MASTER_ADDR"], 0, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        servers.append(server)
        store.set(f"{index}/port", str(server.port))
    return int(store.get(f"{index}/port"))


def _free_memory() -> None:
    """Free what an earlier run left; CUDA is touched only once a run has set up its device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str]) -> int:
    runs = split_runs(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _agent_store()
    servers: list[dist.TCPStore] = []
    for index, run_argv in enumerate(runs):
        os.environ["MASTER_PORT"] = str(_run_store(store, index, rank, servers))
        _meet(store, f"{index}/start", world)
        if rank == 0:
            line = f"{MARKER}{index + 1} of {len(runs)}"
            print(line, flush=True)
            print(line, file=sys.stderr, flush=True)
        reset_runtime()
        _free_memory()
        code = run(run_argv)
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0:
            return code
    _meet(store, "end", world)  # rank 0's servers outlive every rank's last use of them
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
