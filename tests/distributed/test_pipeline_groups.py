"""The schedules run over the groups they are given (two gloo ranks).

The default layout is pp 1 (the two ranks are data-parallel); a second ParallelState built with
pp 2 is handed to the schedule as ``pg_collection`` (ours, or as Megatron-Core's
ProcessGroupCollection): the two ranks must run as the two stages of that pipeline and produce
the gradients of the two-stage product computed in one process. After ``destroy_model_parallel``
and a new pp-2 default layout, the schedule without ``pg_collection`` runs on the new default and
its pipeline group is warmed up again (the old layout's record is gone).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import distributed_test

from megatron.core import parallel_state
from megatron.core.parallel_state import ParallelState, build_parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.runtime import get_runtime

SHAPE = (2, 1, 3)  # [s, b, h]
M = 2  # micro-batches


class Stage(torch.nn.Module):
    """Virtual stage ``index``: multiplies its input by a scalar weight ``index + 2``."""

    def __init__(self, index: int, first: bool, config: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(float(index + 2)))
        self.first, self.config = first, config
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor | None) -> torch.Tensor:
        inp = x if self.first else self.input_tensor
        assert inp is not None
        return inp * self.weight


def _forward_step(data_iterator: Any, model: Stage) -> tuple[torch.Tensor, Any]:
    out = model(next(data_iterator) if model.first else None)
    return out, lambda y: (y.sum(), {"loss": y.sum().detach()})


def _train(pp_rank: int, pp: int, vpp: int, pg_collection: Any) -> list[float]:
    """One step of the schedule over ``pg_collection``; this rank's chunks' weight gradients."""
    config = SimpleNamespace(
        hidden_size=SHAPE[2],
        params_dtype=torch.float32,
        calculate_per_token_loss=False,
        no_sync_func=None,
        grad_scale_func=None,
        finalize_model_grads_func=None,
        microbatch_group_size_per_virtual_pipeline_stage=None,
        overlap_p2p_comm=False,
    )
    chunks = [Stage(c * pp + pp_rank, pp_rank == 0 and c == 0, config) for c in range(vpp)]
    data = iter([torch.full(SHAPE, float(i + 1)) for i in range(M)])
    func = get_forward_backward_func(pp, vpp)
    func(
        forward_step_func=_forward_step,
        data_iterator=[data] + [None] * (vpp - 1),
        model=chunks if vpp > 1 else chunks[0],
        num_microbatches=M,
        seq_length=SHAPE[0],
        micro_batch_size=SHAPE[1],
        pg_collection=pg_collection,
    )
    return [float(c.weight.grad) for c in chunks]


def _expected(pp_rank: int, pp: int, vpp: int) -> list[float]:
    """loss = sum_i sum(x_i) * prod(w) / M, so d loss / d w_k = sum_i sum(x_i) * prod(w) / w_k / M."""
    weights = [float(k + 2) for k in range(pp * vpp)]
    total = sum((i + 1) * math.prod(SHAPE) for i in range(M))
    return [total * math.prod(weights) / weights[c * pp + pp_rank] / M for c in range(vpp)]


@pytest.mark.parametrize("vpp", [1, 2])
@distributed_test(world_size=2)
def test_the_schedule_runs_over_the_groups_it_is_given(ps: ParallelState, vpp: int) -> None:
    assert ps.pp_size == 1  # the default layout: no pipeline
    other = build_parallel_state(pp=2)
    assert other.pp_size == 2
    for given in (other, ProcessGroupCollection.from_parallel_state(other)):
        assert _train(other.pp_rank, 2, vpp, given) == _expected(other.pp_rank, 2, vpp)
    assert other.pp_group in get_runtime().layout.warmed_p2p_groups


@distributed_test(world_size=2)
def test_a_new_layout_warms_its_pipeline_group_again(ps: ParallelState) -> None:
    old = build_parallel_state(pp=2)
    _train(old.pp_rank, 2, 1, old)
    assert old.pp_group in get_runtime().layout.warmed_p2p_groups
    parallel_state.destroy_model_parallel()
    assert len(get_runtime().layout.warmed_p2p_groups) == 0

    new = parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, distributed_timeout_minutes=None
    )
    calls: list[Any] = []
    all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting  # this forked rank's own torch.distributed
    try:
        assert _train(new.pp_rank, 2, 1, None) == _expected(new.pp_rank, 2, 1)  # the new default's groups
        _train(new.pp_rank, 2, 1, None)
    finally:
        dist.all_reduce = all_reduce
    assert calls == [new.pp_group]  # warmed up once, in the new layout
    assert new.pp_group in get_runtime().layout.warmed_p2p_groups
