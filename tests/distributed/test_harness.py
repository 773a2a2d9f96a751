"""The harness itself: groups are built, values come back, a failing rank's traceback reaches pytest."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import DistributedTestError, device, distributed_test, run_distributed

from megatron.core.parallel_state import ParallelState


def _sum_ranks(ps: ParallelState) -> tuple[int, int, int, float]:
    x = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(x, group=ps.tp_group)
    return ps.tp_rank, ps.dp_rank, ps.pp_rank, x.item()


def test_groups_and_return_values() -> None:
    out = run_distributed(_sum_ranks, world_size=4, tp=2)
    assert out == [(0, 0, 0, 1.0), (1, 0, 0, 1.0), (0, 1, 0, 5.0), (1, 1, 0, 5.0)]


def _fail_on_rank_one(ps: ParallelState) -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 blocks here until the harness kills it


def test_failure_carries_the_rank_traceback() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 ---.*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, world_size=2, backend="gloo", timeout_s=30)


@pytest.mark.parametrize("tp", [1, 2])
@distributed_test(world_size=2, tp="tp")
def test_decorator_passes_params(ps: ParallelState, tp: int) -> None:
    assert ps.tp_size == tp and ps.dp_size == 2 // tp
