"""Batch samplers that start at a global sample count, and the pretraining data loader.

Resume contract: the samplers depend only on ``(total_samples, consumed_samples, micro_batch_size,
data_parallel_rank, data_parallel_size, seed)``, so a run restarted with the ``consumed_samples``
stored in its checkpoint yields exactly the micro-batches the uninterrupted run would have.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.errors import DataError


def _check_common(
    total_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
) -> None:
    if total_samples <= 0:
        raise DataError(f"the dataset is empty (no samples); check --data-path/--split, got {total_samples}")
    if micro_batch_size <= 0:
        raise ConfigError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data-parallel rank {data_parallel_rank} is outside [0, {data_parallel_size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed samples must be >= 0, got {consumed_samples}")


class MegatronPretrainingSampler:
    """Sequential sampler (``--dataloader-type single``).

    Global samples ``consumed_samples, consumed_samples + 1, ...`` are grouped into chunks of
    ``micro_batch_size * data_parallel_size``; rank r takes ``chunk[r*mbs:(r+1)*mbs]``. The
    randomness is in the dataset's shuffle index. A last partial chunk is dropped with ``drop_last``.

    Raises:
        ValueError: nothing to sample, a bad rank, or ``consumed_samples`` past the end.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_common(
            total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
        if consumed_samples >= total_samples:
            raise DataError(
                f"consumed samples {consumed_samples} >= dataset size {total_samples}; "
                "the run has used all its data (raise --train-samples/--train-iters)"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.chunk = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.chunk <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self.chunk
        if start < self.total_samples and not self.drop_last:
            tail = list(range(start, self.total_samples))[lo : lo + self.micro_batch_size]
            if tail:
                yield tail


class MegatronPretrainingRandomSampler:
    """Endless per-epoch random sampler (``--dataloader-type cyclic``) with data sharding.

    Each rank owns a contiguous bucket of ``total // (mbs * dp) * mbs`` samples, permuted per epoch
    with ``torch.Generator`` seeded ``seed + epoch``; ``consumed_samples`` (global) picks the epoch
    and the offset into it.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int = 0,
    ) -> None:
        _check_common(
            total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.chunk = micro_batch_size * data_parallel_size
        self.seed = seed
        self.active_total = total_samples - total_samples % self.chunk
        if self.active_total == 0:
            raise DataError(
                f"dataset of {total_samples} samples is smaller than one global micro-batch of {self.chunk}"
            )

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        bucket = self.active_total // self.data_parallel_size
        start = self.data_parallel_rank * bucket
        while True:
            epoch, in_epoch = divmod(consumed, self.active_total)
            offset = in_epoch // self.data_parallel_size
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(bucket, generator=g)[offset:].tolist()
            for i in range(0, len(perm) - self.micro_batch_size + 1, self.micro_batch_size):
                yield [start + x for x in perm[i : i + self.micro_batch_size]]
                consumed += self.chunk
            consumed = (epoch + 1) * self.active_total


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int,
    dataloader_type: str = "single",
    seed: int = 0,
    drop_last: bool = True,
) -> DataLoader | None:
    """A DataLoader of collated micro-batches for this data-parallel rank, starting at the global
    sample ``consumed_samples``.

    Args:
        dataset: map-style dataset (None on ranks that hold no data: returns None).
        consumed_samples: global samples consumed before this point (from the checkpoint).
        micro_batch_size, data_parallel_rank, data_parallel_size: the batch layout.
        num_workers: worker processes (``--num-workers``; 0 loads in the main process).
        dataloader_type: ``single`` (sequential, finite) or ``cyclic`` (random, endless).
        seed: seed of the cyclic sampler.
        drop_last: drop a last incomplete global micro-batch (single only).

    Raises:
        ValueError: an unknown ``dataloader_type`` or an invalid layout.
    """
    if dataset is None:
        return None
    if num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {num_workers}")
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            drop_last,
        )
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, seed
        )
    else:
        raise ConfigError(
            f"--dataloader-type {dataloader_type!r} is not valid; choose one of ['single', 'cyclic']"
        )
    if num_workers > 0:
        _reap_workers_at_exit()
    return _PretrainingDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # Own generator: creating the iterator must not consume the global RNG (exact resume of dropout).
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(worker_init, _os_parent_of_workers()) if num_workers > 0 else None,
    )


def _os_parent_of_workers() -> int | None:
    """This process's pid when DataLoader workers will be its OS children (fork and spawn; with
    forkserver their parent is the server), else None."""
    return os.getpid() if torch.multiprocessing.get_start_method() in ("fork", "spawn") else None


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class _PretrainingDataLoader(DataLoader):
    """A DataLoader whose workers start with the stop signals blocked: a worker is forked (or
    spawned) with its parent's signal mask, and until ``worker_init`` has made it ignore them, a
    SIGTERM or SIGINT sent to the rank's process group would kill it (torch's worker handler lets
    only its parent's SIGTERM through quietly). Signals that arrive meanwhile reach the rank when
    the workers are up."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        before = set(multiprocessing.active_children())
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            _WORKERS.update(c for c in multiprocessing.active_children() if c not in before)


def worker_init(parent_pid: int | None, worker_id: int) -> None:
    """Make a DataLoader worker deaf to SIGTERM and SIGINT, and bound to its rank's life.

    torchrun, SLURM and a terminal's Ctrl-C signal the rank's whole process group, workers included;
    a worker that died of it would crash the rank ("DataLoader worker exited unexpectedly") before
    it could finish the step and save. The rank alone decides when to stop, and its workers never
    outlive it: on Linux they get SIGKILL when the thread that started them (the rank's main thread,
    which creates every iterator) exits; elsewhere the DataLoader's own watchdog stops them within
    seconds. (The rank started them with the stop signals blocked: unblocked here, once ignored.)
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:  # the rank died before prctl took effect
        os._exit(0)


_WORKERS: weakref.WeakSet = weakref.WeakSet()  # the worker processes this process's loaders started


@functools.cache
def _reap_workers_at_exit() -> None:
    """At interpreter exit, multiprocessing terminates daemonic children (SIGTERM) and joins them;
    the workers ignore SIGTERM, so a worker still running then (an iterator alive at exit, e.g. after
    an exception) would be joined forever. This hook, registered after multiprocessing's and so run
    before it, kills and reaps them first. Registered once per process."""

    def kill_workers() -> None:
        live = [w for w in list(_WORKERS) if w.is_alive()]
        if live:
            signal.signal(
                signal.SIGCHLD, signal.SIG_DFL
            )  # the DataLoader's handler would call this a failure
        for worker in live:
            worker.kill()
            worker.join()

    atexit.register(kill_workers)
