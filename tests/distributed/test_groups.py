"""initialize_model_parallel builds real groups whose members match the rank grid."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import device, distributed_test

from megatron.core.parallel_state import ParallelState


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
@distributed_test(world_size=4, tp="tp", pp="pp")
def test_groups_match_the_grid(ps: ParallelState, tp: int, pp: int) -> None:
    rank = dist.get_rank()
    grid = ps.grid
    assert (ps.tp_size, ps.pp_size, ps.dp_size) == (tp, pp, 4 // (tp * pp))
    c = grid.coords(rank)
    assert (ps.tp_rank, ps.pp_rank, ps.dp_rank) == (c["tp"], c["pp"], c["dp"])
    for name, axes in [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp"), ("tp_dp", "tp-dp")]:
        ranks = ps.group_ranks[name]
        assert rank in ranks and ranks in grid.groups(axes), name
        # The group object really spans those ranks: an all-reduce of global ranks sums them.
        x = torch.tensor([float(rank)], device=device())
        dist.all_reduce(x, group=ps.groups[name])
        assert x.item() == sum(ranks), name
    pipeline = ps.group_ranks["pp"]
    assert ps.group_ranks["embedding"] == sorted({pipeline[0], pipeline[-1]})
    assert ps.is_pipeline_first_stage() == (ps.pp_rank == 0)
    assert ps.is_pipeline_last_stage() == (ps.pp_rank == pp - 1)
