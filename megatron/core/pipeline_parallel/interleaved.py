"""Interleaved 1F1B for virtual pipeline chunks (Megatron's ``forward_backward_pipelining_with_interleaving``).

Each pipeline rank holds ``v`` model chunks; chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``.
Micro-batches run in groups of ``G`` (``--microbatch-group-size-per-virtual-pipeline-stage``,
default ``pp``): for each group, every chunk in order, every micro-batch of the group. Backward
visits the same table with chunks reversed.

Rounds. Rank ``r`` runs rounds ``t = -1, 0, 1, ...``: in round ``t`` it runs forward ``t`` (if
``t < M * v``), then backward ``t - D_r`` with ``D_r = 2 (pp - r - 1) + (v - 1) G`` (Megatron's
warm-up count), then one batched exchange with its neighbours. Round ``t`` of rank ``r`` happens
at global step ``t + r``; every message is sent and received at the same global step (the receiver
knows the sender's schedule, so it knows whether and for which chunk a tensor arrives). This is a
lock-step wave, hence deadlock-free, and it needs ``G >= pp`` (and a last partial group of at least
``pp``) so that the last rank's chunk ``c`` output reaches rank 0 before its chunk ``c + 1`` needs it.
When the warm-up would exceed ``M * v`` (few micro-batches), ranks simply idle in some rounds
instead of capping the warm-up, which keeps the wave intact.

Overlap (``--overlap-p2p-communication``, default on): a round's exchange is split in two, the
activations posted right after the forward and waited for after the backward, the gradients posted
after the backward and waited for before the next round's backward, so transfers run during
compute. Per pair of ranks the messages keep the unsplit order, so the pairing is the same.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.pipeline_parallel.p2p_communication import Exchange, P2PCommunicator
from megatron.core.pipeline_parallel.schedule_steps import (
    ForwardStepFunc,
    GradSync,
    backward_step,
    check_schedule_options,
    communicator_for,
    deallocate_output_tensor,
    finalize,
    forward_step,
    model_config,
)


def check_interleaving(num_microbatches: int, pp: int, group_size: int | None) -> int:
    """The micro-batch group size G.

    Rules (Megatron's): ``pp <= G <= M`` and ``M mod G`` is 0 or at least ``pp``.

    Raises:
        ConfigError: the micro-batch count does not fit, naming the parameters to change.
    """
    g = pp if group_size is None else group_size
    what = (
        f"the interleaved pipeline schedule runs {num_microbatches} micro-batches per step "
        "(global_batch_size / (micro_batch_size x data-parallel size))"
    )
    group = "microbatch_group_size_per_virtual_pipeline_stage"
    if g < pp:
        raise ConfigError(
            f"{group} {g} must be at least pipeline_model_parallel_size {pp}",
            params=(group, "pipeline_model_parallel_size"),
        )
    if num_microbatches < g:
        raise ConfigError(
            f"{what}; it needs at least {g} (the micro-batch group size, default "
            f"pipeline_model_parallel_size {pp}): raise global_batch_size",
            params=("global_batch_size", "micro_batch_size", "pipeline_model_parallel_size"),
        )
    rest = num_microbatches % g
    if rest != 0 and rest < pp:
        raise ConfigError(
            f"{what}; with micro-batch groups of {g} the last group has {rest} < "
            f"pipeline_model_parallel_size {pp}: use a multiple of {g} micro-batches "
            f"(global_batch_size)",
            params=("global_batch_size", "micro_batch_size", "pipeline_model_parallel_size"),
        )
    return g


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Forward order as ``(micro_batch, chunk)``: per group of micro-batches, every chunk in turn."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        group = range(start, min(start + group_size, num_microbatches))
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in group)
    return table


class RoundPlan:
    """What every rank computes and sends in each round (pure arithmetic, shared by all ranks)."""

    def __init__(self, num_microbatches: int, num_chunks: int, pp: int, group_size: int, forward_only: bool):
        self.m, self.v, self.pp, self.forward_only = num_microbatches, num_chunks, pp, forward_only
        self.table = schedule_table(num_microbatches, num_chunks, group_size)
        self.total = len(self.table)
        self.g = group_size

    def delay(self, rank: int) -> int:
        return 2 * (self.pp - rank - 1) + (self.v - 1) * self.g

    def fwd(self, rank: int, t: int) -> int | None:
        return t if 0 <= t < self.total else None

    def bwd(self, rank: int, t: int) -> int | None:
        k = t - self.delay(rank)
        return k if not self.forward_only and 0 <= k < self.total else None

    def fchunk(self, k: int) -> int:
        return self.table[k][1]

    def bchunk(self, k: int) -> int:
        return self.v - 1 - self.table[k][1]

    def last_round(self, rank: int) -> int:
        return self.total - 1 if self.forward_only else self.delay(rank) + self.total - 1

    def sends_fwd(self, rank: int, t: int) -> int | None:
        """Chunk whose output ``rank`` sends to the next rank in round ``t`` (None: no send)."""
        k = self.fwd(rank, t)
        if k is None or (rank == self.pp - 1 and self.fchunk(k) == self.v - 1):
            return None
        return self.fchunk(k)

    def sends_bwd(self, rank: int, t: int) -> int | None:
        """Chunk whose input gradient ``rank`` sends to the previous rank in round ``t``."""
        k = self.bwd(rank, t)
        if k is None or (rank == 0 and self.bchunk(k) == 0):
            return None
        return self.bchunk(k)

    def recv_fwd(self, rank: int, t: int) -> int | None:
        """Chunk (of ``rank``) for which an activation arrives from the previous rank in round ``t``."""
        prev = (rank - 1) % self.pp
        c = self.sends_fwd(prev, t + rank - prev)
        return None if c is None else c + (1 if rank == 0 else 0)

    def recv_bwd(self, rank: int, t: int) -> int | None:
        """Chunk (of ``rank``) for which an output gradient arrives from the next rank in round ``t``."""
        nxt = (rank + 1) % self.pp
        c = self.sends_bwd(nxt, t + rank - nxt)
        return None if c is None else c - (1 if rank == self.pp - 1 else 0)


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: list[Any] | None,
    model: list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Any = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> list[Any]:
    """Interleaved 1F1B over ``model`` (one chunk per virtual stage of this rank); ``force_all_reduce``
    must be False. The stages exchange through ``p2p_communicator``, else through one over
    ``pg_collection``'s pipeline group (a ParallelState or a ProcessGroupCollection; None: the
    default ParallelState's), as in ``forward_backward_pipelining_without_interleaving``.

    ``data_iterator`` is a list with one entry per chunk (None where the chunk reads no data).
    Returns the per-micro-batch metrics on the last pipeline rank, an empty list elsewhere.

    Raises:
        ConfigError: fewer than two chunks, or a micro-batch count the schedule cannot run
            (see ``check_interleaving``).
    """
    check_schedule_options(force_all_reduce)
    if not isinstance(model, list) or len(model) < 2:
        raise ConfigError(
            "the interleaved schedule needs a list of >= 2 model chunks per rank "
            "(virtual_pipeline_model_parallel_size >= 2)",
            params=("virtual_pipeline_model_parallel_size",),
        )
    v = len(model)
    iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * v
    config = model_config(model[0])
    comm = communicator_for(p2p_communicator, pg_collection, model[0], config, seq_length, micro_batch_size)
    rank, pp = comm.pp_rank, comm.pp_size
    g = check_interleaving(num_microbatches, pp, config.microbatch_group_size_per_virtual_pipeline_stage)
    plan = RoundPlan(num_microbatches, v, pp, g, forward_only)
    last_bwd = {plan.bchunk(k): k for k in range(plan.total)}  # last backward index of each chunk
    sync = GradSync(config, v, active=not forward_only)
    metrics: list[Any] = []
    num_tokens: list[torch.Tensor] = []
    inputs: list[deque[torch.Tensor | None]] = [deque() for _ in range(v)]  # received activations, per chunk
    grads: list[deque[torch.Tensor | None]] = [
        deque() for _ in range(v)
    ]  # received output gradients, per chunk
    # (input, output) awaiting backward, per chunk
    stored: list[deque[tuple[torch.Tensor | None, torch.Tensor]]] = [deque() for _ in range(v)]

    overlap = getattr(config, "overlap_p2p_comm", False)
    # The previous round's gradient exchange (overlap): (exchange, receiving chunk).
    in_flight: tuple[Exchange, int | None] | None = None

    def take_gradients() -> None:
        nonlocal in_flight
        if in_flight is not None:
            exchange, chunk = in_flight
            got = exchange.wait()[1]
            if chunk is not None:
                grads[chunk].append(got)
            in_flight = None

    for t in range(-1, plan.last_round(rank) + 1):
        send_next: torch.Tensor | None = None
        send_prev: torch.Tensor | None = None
        k = plan.fwd(rank, t)
        if k is not None:
            c = plan.fchunk(k)
            first, last = rank == 0 and c == 0, rank == pp - 1 and c == v - 1
            assert first or inputs[c], f"pipeline rank {rank}: activation for chunk {c} has not arrived"
            input_tensor = None if first else inputs[c].popleft()
            output = forward_step(
                forward_step_func,
                iters[c],
                model[c],
                num_microbatches,
                config,
                forward_only,
                metrics,
                num_tokens,
                input_tensor,
                last,
            )
            if not forward_only:
                stored[c].append((input_tensor, output))
            send_next = None if last else output
        recv_f, recv_b = plan.recv_fwd(rank, t), plan.recv_bwd(rank, t)
        # Overlap: the activation exchange runs during this round's backward; the gradient exchange
        # during the next round's forward. Messages keep the order of the unsplit exchange
        # (activations before gradients within a round), so pairing between ranks is unchanged.
        forward_exchange = comm.post(send_next=send_next, recv_prev=recv_f is not None) if overlap else None
        take_gradients()
        k = plan.bwd(rank, t)
        if k is not None:
            c = plan.bchunk(k)
            first, last = rank == 0 and c == 0, rank == pp - 1 and c == v - 1
            assert last or grads[c], f"pipeline rank {rank}: gradient for chunk {c} has not arrived"
            output_grad = None if last else grads[c].popleft()
            input_tensor, output = stored[c].popleft()
            if last_bwd[c] == k:
                sync.enable(c)
            input_grad = backward_step(input_tensor, output, output_grad, config)
            send_prev = None if first else input_grad
        if forward_exchange is not None:
            in_flight = (comm.post(send_prev=send_prev, recv_next=recv_b is not None), recv_b)
            got_f = forward_exchange.wait()[0]
        else:
            got_f, got_b = comm.communicate(
                send_next=send_next,
                send_prev=send_prev,
                recv_prev=recv_f is not None,
                recv_next=recv_b is not None,
            )
            if recv_b is not None:
                grads[recv_b].append(got_b)
        if not forward_only:
            deallocate_output_tensor(send_next)
        if recv_f is not None:
            inputs[recv_f].append(got_f)
    take_gradients()
    sync.enable_all()
    finalize(config, model, num_tokens, forward_only)
    return metrics if rank == pp - 1 else []
