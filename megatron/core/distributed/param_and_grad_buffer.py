"""The distributed optimizer's bucket layout and the parameter all-gather (Megatron's layout).

With ``--use-distributed-optimizer`` each gradient bucket is one contiguous range of elements: every
parameter starts at a multiple of :data:`PARAM_ALIGN` elements and the bucket's length is padded to a
multiple of ``lcm(dp, 128)``. Data-parallel rank ``r`` owns the contiguous slice
``[r * len / dp, (r + 1) * len / dp)`` of every bucket: its gradients are reduce-scattered into that
slice, the optimizer keeps fp32 main params and moments for the owned elements only, and after the
step one ``all_gather_into_tensor`` per bucket refreshes every replica's weights. The model params
are views into a parameter buffer laid out like the gradient bucket, so the gather writes them in
place; the owned slice of that buffer is what the optimizer writes. Expert parameters' buckets are
laid out and sharded the same way over the expert-data-parallel group instead.

Identical bucket contents give identical layouts on every rank of the data-parallel group, and on
every tensor-parallel rank (equal shard sizes) and the two pipeline stages holding a tied embedding
(which gets a bucket of its own), so owned slices line up wherever gradients are summed again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

PARAM_ALIGN = 64  # elements; every parameter's start in a bucket is a multiple
BUCKET_PAD = 128  # bucket lengths are multiples of lcm(dp, BUCKET_PAD)


def bucket_size(ddp_config: DistributedDataParallelConfig, dp_size: int) -> int:
    """Elements per gradient bucket: ``ddp_config.bucket_size``, else max(40M, 1M x DP), Megatron's
    default for overlap (without overlap the buckets only bound how much gradient memory appears at
    once, and are reduced at the end of the step)."""
    if ddp_config.bucket_size is not None:
        return ddp_config.bucket_size
    return max(40_000_000, 1_000_000 * dp_size)


def bucket_lengths(numels: list[int], limit: int) -> list[int]:
    """How many of the consecutive params of ``numels`` elements each bucket takes: a bucket closes
    as soon as it holds ``limit`` elements or more."""
    lengths, count, size = [], 0, 0
    for n in numels:
        count, size = count + 1, size + n
        if size >= limit:
            lengths.append(count)
            count, size = 0, 0
    return lengths + [count] if count else lengths


@dataclass(frozen=True)
class ReduceDomain:
    """Where a bucket's gradients are summed: ``group`` (``size`` ranks, this one ``rank``), and
    divided by ``divisor`` (the net factor: 1/(dp x cp) for dense and expert buckets alike)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    divisor: int

    @property
    def trivial(self) -> bool:
        """Nothing to do: one rank and no division."""
        return self.size == 1 and self.divisor == 1


NO_REDUCTION = ReduceDomain(None, 1, 0, 1)


def bucket_layout(numels: list[int], dp_size: int) -> tuple[list[int], int]:
    """(start of each parameter, padded bucket length) for parameters of ``numels`` elements."""
    starts, offset = [], 0
    for n in numels:
        offset = -(-offset // PARAM_ALIGN) * PARAM_ALIGN
        starts.append(offset)
        offset += n
    pad = math.lcm(dp_size, BUCKET_PAD)
    return starts, max(pad, -(-offset // pad) * pad)


def shard_range(bucket_numel: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """The slice of a bucket that data-parallel rank ``dp_rank`` owns."""
    assert bucket_numel % dp_size == 0, "buckets are padded to a multiple of the data-parallel size"
    size = bucket_numel // dp_size
    return dp_rank * size, (dp_rank + 1) * size


@dataclass(frozen=True)
class Piece:
    """The owned elements [start, stop) of ``param`` (flat, row-major): ``data`` is their view in the
    parameter buffer (what the optimizer updates) and ``grad`` reads them from ``param.main_grad``."""

    param: nn.Parameter
    start: int
    stop: int
    data: torch.Tensor

    def grad(self) -> torch.Tensor | None:
        main_grad: torch.Tensor | None = getattr(self.param, "main_grad", None)
        return None if main_grad is None else main_grad.view(-1)[self.start : self.stop]


class ParamBuffer:
    """One bucket's parameters as views into one contiguous tensor of the bucket's layout (padding
    zeros); ``pieces`` are the elements this data-parallel rank owns, in the bucket's order. ``group``
    is the group it is sharded over (``dp_size`` ranks: dp x cp, or expert-dp for expert buckets)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        starts: list[int],
        numel: int,
        dp_size: int,
        dp_rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, "a bucket holds parameters of one dtype"
        self.params = params
        self.group, self.dp_size = group, dp_size
        self.data = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.shard = shard_range(numel, dp_size, dp_rank)
        self.pieces: list[Piece] = []
        lo, hi = self.shard
        with torch.no_grad():
            for p, start in zip(params, starts):
                view = self.data[start : start + p.numel()]
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)
                first, last = max(lo, start), min(hi, start + p.numel())
                if first < last:
                    self.pieces.append(Piece(p, first - start, last - start, self.data[first:last]))

    def shard_data(self) -> torch.Tensor:
        lo, hi = self.shard
        return self.data[lo:hi]


class ParamGather:
    """After an optimizer step: one ``all_gather_into_tensor`` per bucket from each rank's owned slice
    into every replica's parameter buffer, in the order the forward pass uses the buckets, over the
    group the buffer is sharded over (``dp_group`` where the buffer names none).

    Without ``overlap`` the step waits for all of them. With ``overlap`` (``--overlap-param-gather``)
    nothing waits at the step: :meth:`attach` makes each transformer layer (just before it runs) and
    every other module holding parameters (a forward pre-hook) wait for its own buckets only, so the
    gathers run beside the next forward pass. On NCCL a wait orders the compute stream after the
    gather; the host does not block. Whatever reads the parameters outside a forward pass (checkpoint
    saving, the next optimizer step) calls :meth:`wait_all` first.
    """

    def __init__(
        self, buffers: list[ParamBuffer], dp_group: dist.ProcessGroup | None, overlap: bool = False
    ) -> None:
        self.buffers, self.dp_group, self.overlap = buffers, dp_group, overlap
        self.bucket_of = {id(p): i for i, b in enumerate(buffers) for p in b.params}
        self.pending: dict[int, dist.Work] = {}  # bucket index -> its gather's work handle

    @torch.no_grad()
    def __call__(self) -> None:
        self.wait_all()
        for i, buffer in enumerate(self.buffers):
            if buffer.dp_size == 1:  # this rank owns the whole bucket
                continue
            group = buffer.group if buffer.group is not None else self.dp_group
            work = dist.all_gather_into_tensor(buffer.data, buffer.shard_data(), group=group, async_op=True)
            assert work is not None  # async_op=True returns the work handle
            self.pending[i] = work
        if not self.overlap:
            self.wait_all()

    def wait_for(self, params: Iterable[nn.Parameter]) -> None:
        """Wait for the gathers of the buckets holding ``params`` still in flight (none: nothing to do)."""
        if not self.pending:
            return
        for p in params:
            index = self.bucket_of.get(id(p))
            handle = self.pending.pop(index, None) if index is not None else None
            if handle is not None:
                handle.wait()

    def wait_all(self) -> None:
        for handle in self.pending.values():
            handle.wait()
        self.pending.clear()

    def attach(self, chunks: list[nn.Module]) -> None:
        """Wait points for ``overlap``: each layer of a block with ``before_layer`` (the compiled unit,
        so no hook runs inside a compiled graph), every other module with parameters of its own, and
        a model's output layer also at the end of its decoder block (the fused loss reads its weight)."""
        inside: set[int] = set()
        for chunk in chunks:
            for module in chunk.modules():
                hooks: list[Callable[[nn.Module], None]] | None = getattr(module, "before_layer", None)
                if hooks is not None:
                    hooks.append(lambda layer: self.wait_for(layer.parameters()))
                    layers: nn.Module = module.layers  # type: ignore[assignment]
                    inside.update(id(m) for layer in layers.children() for m in layer.modules())
        for chunk in chunks:
            for module in chunk.modules():
                if id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
                    module.register_forward_pre_hook(
                        lambda m, args: self.wait_for(m.parameters(recurse=False))
                    )
                # The fused output-layer loss reads the output layer's weight without calling the
                # layer, so its pre-hook never runs: the block before it waits for it as it ends.
                head, block = getattr(module, "output_layer", None), getattr(module, "decoder", None)
                if isinstance(head, nn.Module) and isinstance(block, nn.Module):
                    block.register_forward_hook(
                        lambda m, args, out, head=head: self.wait_for(head.parameters(recurse=False))
                    )
