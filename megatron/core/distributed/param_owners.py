"""Which data-parallel rank owns (optimizes) each parameter under ``--use-distributed-optimizer``.

Each parameter is owned whole by one data-parallel rank: its gradient is reduced to that rank, only
that rank keeps its fp32 main copy and Adam moments, updates it and broadcasts the new weights to
the other replicas. Whole parameters keep the optimizer state's checkpoint layout identical to the
non-distributed optimizer's (so checkpoints reshard across any data-parallel size, and between the
two optimizers); the cost is a coarser balance than splitting inside tensors.

The assignment is the longest-processing-time greedy rule over element counts (largest parameter
first, to the least-loaded rank; ties to the lower rank), deterministic on every rank: tensor-
parallel ranks hold equally sized shards, so every tp rank of one data-parallel rank gets the same
set. Word embeddings and their tied output-layer copies always go to rank 0, so the first and last
pipeline stages agree on who holds the full gradient they exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.config_utils import ConfigError


def assign_owners(
    params: list[nn.Parameter], dp_size: int, pinned: tuple[torch.Tensor, ...] = ()
) -> dict[int, int]:
    """``id(param) -> owning data-parallel rank`` for ``params`` (in a rank-independent order);
    the ``pinned`` params (tied word embeddings) go to rank 0.

    Raises:
        ConfigError: fewer parameters than data-parallel ranks (a rank would own nothing).
    """
    if len(params) < dp_size:
        raise ConfigError(
            f"use_distributed_optimizer needs at least one parameter per data-parallel rank: "
            f"{len(params)} parameters for {dp_size} ranks; turn use_distributed_optimizer off "
            "for so small a model",
            params=("use_distributed_optimizer",),
        )
    load = [0] * dp_size
    owners: dict[int, int] = {}
    pinned_ids = {id(p) for p in pinned}
    for p in params:
        if id(p) in pinned_ids:
            owners[id(p)] = 0
            load[0] += p.numel()
    rest = sorted(
        (p for p in params if id(p) not in owners), key=lambda p: -p.numel()
    )  # stable: ties keep order
    for p in rest:
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        owners[id(p)] = rank
        load[rank] += p.numel()
    return owners


class ParamBroadcast:
    """After an optimizer step: every parameter's new value from its owner to the other data-parallel
    replicas (asynchronous broadcasts, in the order the forward pass uses the parameters).

    Without ``overlap`` the step waits for all of them. With ``overlap`` (``--overlap-param-gather``)
    nothing waits at the step: :meth:`attach` makes each transformer layer (just before it runs) and
    every other module holding parameters (a forward pre-hook) wait for its own parameters only, so
    the broadcasts run beside the next forward pass. On NCCL a wait orders the compute stream after
    the broadcast; the host does not block. Whatever reads the parameters outside a forward pass
    (checkpoint saving, the next optimizer step) calls :meth:`wait_all` first.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        owners: dict[int, int],
        dp_group: dist.ProcessGroup,
        overlap: bool = False,
    ) -> None:
        self.params, self.owners, self.dp_group, self.overlap = params, owners, dp_group, overlap
        self.src = {r: dist.get_global_rank(dp_group, r) for r in set(owners.values())}
        self.pending: dict[int, dist.Work] = {}  # id(param) -> its broadcast's work handle

    @torch.no_grad()
    def __call__(self) -> None:
        self.wait_all()
        for p in self.params:
            work = dist.broadcast(
                p.data, src=self.src[self.owners[id(p)]], group=self.dp_group, async_op=True
            )
            assert work is not None  # async_op=True returns the work handle
            self.pending[id(p)] = work
        if not self.overlap:
            self.wait_all()

    def wait_for(self, params: Iterable[nn.Parameter]) -> None:
        """Wait for the broadcasts of ``params`` still in flight (none: nothing to do)."""
        if not self.pending:
            return
        for p in params:
            handle = self.pending.pop(id(p), None)
            if handle is not None:
                handle.wait()

    def wait_all(self) -> None:
        for handle in self.pending.values():
            handle.wait()
        self.pending.clear()

    def attach(self, chunks: list[nn.Module]) -> None:
        """Wait points for ``overlap``: each layer of a block with ``before_layer`` (the compiled unit,
        so no hook runs inside a compiled graph) and every other module with parameters of its own."""
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
