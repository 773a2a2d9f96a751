"""Point-to-point exchange of activations and their gradients between neighbouring pipeline stages.

Every exchange is one batch of ``torch.distributed.P2POp`` (isend / irecv) posted together with
``batch_isend_irecv``, so two neighbours that both send and receive in the same call never deadlock
(on NCCL the batch is one ``ncclGroupStart/End``; on gloo the ops are simply asynchronous).
``communicate`` waits for it; ``post`` returns it in flight, for the interleaved schedule to overlap
with compute. Tensor shapes and dtypes are fixed in advance (``[s(/tp with sequence
parallelism), micro_batch_size, h]``), so no shape handshake is ever exchanged.

The ring is closed: the stage after the last pipeline rank is rank 0 and vice versa. Plain 1F1B
never uses the wrap-around links; the interleaved schedule uses them to pass chunk ``c`` of the
last rank to chunk ``c + 1`` of the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.runtime import get_runtime


class P2PCommunicator:
    """Sends and receives pipeline tensors to / from the previous and next pipeline rank.

    Args:
        pp_group: this rank's pipeline group.
        pp_ranks: the global ranks of that group, in pipeline order.
        pp_rank: this rank's position in ``pp_ranks``.
        tensor_shape: shape of every activation exchanged (``[s, b, h]``).
        dtype: dtype of the activations (the model's compute dtype).
        device: where received tensors are allocated (the rank's GPU under NCCL, else CPU).

    Every method takes ``recv_*`` flags; a False flag returns None without communicating, and a
    None tensor to send is not sent. Received activations have ``requires_grad=True``.

    The first communicator of a pipeline group runs one all-reduce over it (NCCL wants a
    communicator's first operation to involve every rank); the runtime's layout state records the
    groups warmed up (``LayoutState.warmed_p2p_groups``), so it runs once per group and layout.
    """

    def __init__(
        self,
        pp_group: ProcessGroup | None,
        pp_ranks: Sequence[int],
        pp_rank: int,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group = pp_group
        self.pp_ranks = list(pp_ranks)
        self.pp_rank = pp_rank
        self.pp_size = len(self.pp_ranks)
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self.next_rank = self.pp_ranks[(pp_rank + 1) % self.pp_size]
        self.prev_rank = self.pp_ranks[(pp_rank - 1) % self.pp_size]
        self._warm_up()

    def _warm_up(self) -> None:
        warmed = get_runtime().layout.warmed_p2p_groups
        if self.group is None or self.group in warmed or self.pp_size == 1:
            return
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        warmed.add(self.group)

    def _empty(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(
            self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
        )

    def communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched exchange, waited for. Returns ``(tensor from prev, tensor from next)``.

        ``send_next`` (an activation) goes to the next rank, ``send_prev`` (an input gradient) to the
        previous rank; ``recv_prev`` receives an activation from the previous rank (returned with
        ``requires_grad=True``) and ``recv_next`` a gradient from the next rank.
        """
        return self.post(
            send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next
        ).wait()

    def post(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> Exchange:
        """Start one batched exchange (as :meth:`communicate`) without waiting: compute can run while
        it is in flight; ``wait()`` on the result returns the received tensors. Sent tensors must not
        be modified before then."""
        ops: list[dist.P2POp] = []
        from_prev = self._empty(True) if recv_prev else None
        from_next = self._empty(False) if recv_next else None
        # With pp == 2 both neighbours are the same rank and messages to one peer match in posting
        # order, so activations are always posted before gradients, on the sending and receiving side.
        if send_next is not None:
            ops.append(
                dist.P2POp(dist.isend, _checked(send_next, self.tensor_shape), self.next_rank, self.group)
            )
        if send_prev is not None:
            ops.append(
                dist.P2POp(dist.isend, _checked(send_prev, self.tensor_shape), self.prev_rank, self.group)
            )
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group))
        return Exchange(dist.batch_isend_irecv(ops) if ops else [], from_prev, from_next)

    # Megatron-Core's names for the combinations the schedules use.
    def recv_forward(self, recv: bool = True) -> torch.Tensor | None:
        return self.communicate(recv_prev=recv)[0]

    def recv_backward(self, recv: bool = True) -> torch.Tensor | None:
        return self.communicate(recv_next=recv)[1]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self.communicate(send_next=output)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(
        self, output: torch.Tensor | None, recv: bool = True
    ) -> torch.Tensor | None:
        return self.communicate(send_next=output, recv_next=recv)[1]

    def send_backward_recv_forward(
        self, input_grad: torch.Tensor | None, recv: bool = True
    ) -> torch.Tensor | None:
        return self.communicate(send_prev=input_grad, recv_prev=recv)[0]


class Exchange:
    """An exchange in flight: ``wait()`` finishes it once and returns ``(from prev, from next)``."""

    def __init__(
        self, requests: list[Any], from_prev: torch.Tensor | None, from_next: torch.Tensor | None
    ) -> None:
        self.requests, self.received = requests, (from_prev, from_next)

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for req in self.requests:
            req.wait()
        self.requests = []
        return self.received


def _checked(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise RuntimeError(
            f"pipeline tensor of shape {tuple(tensor.shape)} does not match the agreed shape "
            f"{shape} ([seq (/tp with sequence parallelism), micro-batch, hidden])"
        )
    return tensor.detach().contiguous()
