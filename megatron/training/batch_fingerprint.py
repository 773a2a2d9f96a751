"""A fingerprint of each training step's global batch of tokens, the same under every layout.

``--log-batch-fingerprint`` prints, on rank 0 after each step, ``batch fingerprint at iteration N:
<16 hex digits>``; a resumed run prints the fingerprint of its first step in its resume block. Two runs
that read the same samples in the same order at a step print the same fingerprint, whatever their
tensor-, pipeline- or data-parallel sizes and micro-batch sizes.

How: each sample's tokens are hashed where the loader hands them over (on the CPU, before they go to
the device: no device sync), by the ranks that read tokens (tp rank 0 of the first pipeline stage).
After the step, those ranks gather the step's per-sample digests over the data-parallel group (the gloo
twin of the group, CPU int64s) and hash them in global sample order. ``MegatronPretrainingSampler``
hands micro-batch ``m`` of dp rank ``r`` the step's samples ``m*mbs*dp + r*mbs + i`` (``i < mbs``),
which ``global_order`` undoes.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.parallel_state_grid import default_group_timeout

DIGEST_BYTES = 8


def sample_digests(tokens: torch.Tensor) -> list[int]:
    """One signed 64-bit digest per sample of ``tokens`` ``[b, s]`` (blake2b of its int64 ids)."""
    rows = tokens.detach().to("cpu", torch.int64).contiguous()
    return [
        int.from_bytes(
            hashlib.blake2b(row.numpy().tobytes(), digest_size=DIGEST_BYTES).digest(), "little", signed=True
        )
        for row in rows
    ]


def global_order(gathered: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Per-sample digests ``[dp, n]`` (row r: dp rank r's, in the order it read them) as ``[dp * n]`` in
    global sample order (position ``m*mbs*dp + r*mbs + i`` holds row r's entry ``m*mbs + i``)."""
    dp, n = gathered.shape
    assert n % micro_batch_size == 0, (n, micro_batch_size)
    return gathered.view(dp, n // micro_batch_size, micro_batch_size).permute(1, 0, 2).reshape(-1)


def combine(digests: torch.Tensor) -> str:
    """The fingerprint (16 hex digits) of per-sample digests in global sample order."""
    data = digests.to(torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


def fingerprint(samples: torch.Tensor) -> str:
    """The fingerprint of one global batch given as ``[n, s]`` tokens in global sample order."""
    return combine(torch.tensor(sample_digests(samples), dtype=torch.int64))


def gloo_dp_group(pg: Any) -> Any:
    """The gloo twin of ``pg``'s data-parallel group (``pg.groups['dp_gloo']``), built when missing:
    collective, so every rank calls it; under a gloo default backend it is the dp group itself."""
    if pg.groups.get("dp_gloo") is not None:
        return pg.groups["dp_gloo"]
    if pg.dp_size == 1 or not dist.is_initialized():
        return pg.dp_group
    if dist.get_backend() == "gloo":
        return pg.dp_group
    timeout = default_group_timeout()
    mine = None
    for ranks in pg.grid.groups("dp"):
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if pg.rank in ranks:
            mine, pg.group_ranks["dp_gloo"] = group, list(ranks)
    pg.groups["dp_gloo"] = mine
    return mine


class _Hashing:
    """An iterator of loader batches that records each sample's digest as it hands the batch on."""

    def __init__(self, inner: Iterator, owner: BatchFingerprints) -> None:
        self.inner, self.owner = inner, owner

    def __iter__(self) -> _Hashing:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        if self.owner.active:
            self.owner.pending.extend(sample_digests(batch["tokens"]))
        return batch


class BatchFingerprints:
    """The fingerprints of the training steps, computed from the batches the loader hands over.

    ``reads_tokens``: this rank reads the tokens (tp rank 0 of the first pipeline stage); every such
    rank of one data-parallel group must call ``step`` for the same steps (it gathers over ``group``,
    of ``dp_size`` ranks; a gloo group keeps the gather on the CPU).
    """

    def __init__(self, reads_tokens: bool, dp_size: int, micro_batch_size: int, group: Any = None) -> None:
        self.reads_tokens = reads_tokens
        self.dp_size, self.micro_batch_size, self.group = dp_size, micro_batch_size, group
        self.pending: collections.deque[int] = collections.deque()
        self.active = True  # False: batches pass unhashed (``stop``)

    def wrap(self, train_iter: list) -> list:
        """``train_iter`` (one entry per model chunk) with the first chunk's iterator hashing its
        batches on the ranks that read tokens."""
        if not self.reads_tokens or not train_iter or train_iter[0] is None:
            return train_iter
        return [_Hashing(train_iter[0], self), *train_iter[1:]]

    def stop(self) -> None:
        """Hash no further batches (every token reader of the group stops at the same step)."""
        self.active = False
        self.pending.clear()

    def step(self, global_batch_size: int) -> str | None:
        """The fingerprint of the next step's ``global_batch_size`` samples (read from the loader by
        now); None on ranks that do not read tokens. Collective over the group's token readers."""
        if not self.reads_tokens:
            return None
        n = global_batch_size // self.dp_size
        assert len(self.pending) >= n, f"the step's {n} samples were not all read ({len(self.pending)})"
        local = torch.tensor([self.pending.popleft() for _ in range(n)], dtype=torch.int64)
        if self.dp_size == 1:
            return combine(local)
        device = torch.device("cpu")
        if self.group is not None and dist.get_backend(self.group) != "gloo":  # a device gather
            device = torch.device("cuda", torch.cuda.current_device())
        parts = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(self.dp_size)]
        dist.all_gather(parts, local.to(device), group=self.group)
        gathered = torch.stack(parts).cpu()
        return combine(global_order(gathered, self.micro_batch_size))
