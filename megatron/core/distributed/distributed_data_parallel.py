"""Data-parallel wrapper with a contiguous main-gradient buffer.

Every trainable parameter gets ``param.main_grad``, a view into one contiguous buffer (fp32 when
``grad_reduce_in_fp32``). A post-accumulate hook adds each freshly computed ``param.grad`` into it
and frees ``param.grad``, so gradients accumulate across micro-batches in full precision whatever
the parameter dtype. ``finish_grad_sync`` reduces the buffer across the data-parallel group.
Parameters are laid out in reverse registration order (roughly the order backward produces them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.parallel_state import ParallelState, get_parallel_state


class DistributedDataParallel(nn.Module):
    """Wraps ``module``; ``forward`` is the module's. Megatron-Core's constructor signature."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: nn.Module,
                 parallel_state: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.pg = parallel_state if parallel_state is not None else get_parallel_state()
        self.dp_group = self.pg.dp_cp_group
        self.dp_size = self.pg.dp_size * self.pg.cp_size
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else (params[0].dtype if params else torch.float32)
        self.grad_buffer = torch.zeros(sum(p.numel() for p in params), dtype=grad_dtype, device=device)
        offset = 0
        self._hooks = []
        for p in reversed(params):
            p.main_grad = self.grad_buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_into_main_grad))
        self._sync_enabled = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Defer gradient reduction (all micro-batches but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for p in self.module.parameters():
            p.grad = None

    def finish_grad_sync(self) -> None:
        """Sum (or average) the gradient buffer over the data-parallel (x context-parallel) group."""
        if self.dp_size == 1 or self.dp_group is None:
            return
        if self.ddp_config.average_in_collective:
            dist.all_reduce(self.grad_buffer, op=dist.ReduceOp.AVG, group=self.dp_group)
        else:
            self.grad_buffer.mul_(1.0 / self.dp_size)
            dist.all_reduce(self.grad_buffer, group=self.dp_group)

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        self.grad_buffer.mul_(factor)

    # Checkpointing and attribute access go to the wrapped module.
    def sharded_state_dict(self, prefix: str = "", *args, **kwargs) -> dict:
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None
