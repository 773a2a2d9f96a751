"""Megatron-Core's parallel_state getters on 4 gloo ranks: the groups, ranks and sizes they return
match Megatron's layout (RankGenerator), and the group objects really span those ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import device, run_distributed

from megatron.core import parallel_state as ps
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.parallel_state import ParallelState, RankGenerator, default_group_timeout
from megatron.core.process_groups_config import ProcessGroupCollection


def _spans(group, ranks: list[int]) -> bool:
    x = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(x, group=group)
    return dist.get_process_group_ranks(group) == ranks and x.item() == sum(ranks)


def _mine(groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if dist.get_rank() in g)


def _dense_tp2_pp2(rank: int) -> None:
    """tp2 x pp2 on 4 ranks (the harness's layout), checked against RankGenerator."""
    gen = RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    tp, pp, mp = _mine(gen.get_ranks("tp")), _mine(gen.get_ranks("pp")), _mine(gen.get_ranks("tp-pp"))
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_pipeline_model_parallel_world_size() == 2
    assert ps.get_tensor_model_parallel_rank() == tp.index(rank)
    assert ps.get_pipeline_model_parallel_rank() == pp.index(rank)
    assert ps.get_data_parallel_world_size() == 1 and ps.get_data_parallel_rank() == 0
    assert _spans(ps.get_tensor_model_parallel_group(), tp)
    assert _spans(ps.get_pipeline_model_parallel_group(), pp)
    assert _spans(ps.get_model_parallel_group(), mp)
    assert _spans(ps.get_embedding_group(), pp)  # first and last stage of a 2-stage pipeline
    if rank == pp[0]:  # only the first stage is in a position-embedding group
        assert dist.get_process_group_ranks(ps.get_position_embedding_group()) == [pp[0]]
    else:
        assert ps.get_position_embedding_group(check_initialized=False) is None
    assert ps.is_rank_in_position_embedding_group() == (rank == pp[0])
    assert ps.get_tensor_model_parallel_src_rank() == tp[0]
    assert ps.get_model_parallel_src_rank() == mp[0]
    assert (ps.get_pipeline_model_parallel_first_rank(), ps.get_pipeline_model_parallel_last_rank()) == (
        pp[0],
        pp[1],
    )
    other = pp[1 - pp.index(rank)]
    assert ps.get_pipeline_model_parallel_next_rank() == ps.get_pipeline_model_parallel_prev_rank() == other
    assert ps.is_pipeline_first_stage() == (rank == pp[0]) and ps.is_pipeline_last_stage() == (rank == pp[1])
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    assert pgs.tp is ps.get_tensor_model_parallel_group() and pgs.pp is ps.get_pipeline_model_parallel_group()
    assert pgs.embd is ps.get_embedding_group() and pgs.hcp is None and pgs.expt_dp is not None


def _expert_ep2(rank: int) -> None:
    """tp1, ep2 on 4 ranks: dense dp 4; expert ep groups [0,1],[2,3], expert dp [0,2],[1,3]."""
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):  # never a lazy collective
        ps.get_tensor_model_parallel_world_size()
    ps.initialize_model_parallel(expert_model_parallel_size=2, distributed_timeout_minutes=None)
    gen = RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert ps.get_data_parallel_world_size() == 4 and ps.get_data_parallel_rank() == rank
    ep, edp = _mine(gen.get_ranks("ep")), _mine(gen.get_ranks("dp"))
    assert ps.get_expert_model_parallel_world_size() == 2 and ps.get_expert_model_parallel_rank() == ep.index(
        rank
    )
    assert ps.get_expert_data_parallel_world_size() == 2 and ps.get_expert_data_parallel_rank() == edp.index(
        rank
    )
    assert ps.get_expert_tensor_parallel_world_size() == 1
    assert _spans(ps.get_expert_model_parallel_group(), ep)
    assert _spans(ps.get_expert_data_parallel_group(), edp)
    assert _spans(ps.get_expert_tensor_and_model_parallel_group(), ep)
    assert _spans(ps.get_expert_data_parallel_group_gloo(), edp)
    assert _spans(ps.get_intra_distributed_optimizer_instance_group(), [0, 1, 2, 3])
    assert ps.get_expert_model_parallel_src_rank() == ep[0]
    assert ps.get_parallel_state().axis_rank("ep") == ep.index(rank)


def _order_tp_pp_dp(rank: int) -> None:
    """order tp-pp-dp, pp2: pipelines [0,1],[2,3] and data-parallel groups [0,2],[1,3]."""
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, order="tp-pp-dp", distributed_timeout_minutes=None
    )
    assert _spans(ps.get_pipeline_model_parallel_group(), [0, 1] if rank < 2 else [2, 3])
    assert _spans(ps.get_data_parallel_group(), [rank % 2, rank % 2 + 2])
    assert _spans(ps.get_data_parallel_group(with_context_parallel=True), [rank % 2, rank % 2 + 2])
    assert ps.get_data_parallel_src_rank() == rank % 2
    with pytest.raises(ValueError, match="does not end with pp"):  # dense dp 2, expert dp 1
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            order="tp-ep-pp-dp",
            distributed_timeout_minutes=None,
        )


def _hyper_comm_grid(rank: int) -> None:
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    assert _spans(grid.create_pg("dp"), [rank % 2, rank % 2 + 2])
    assert _spans(grid.create_pg(["tp", "dp"]), [0, 1, 2, 3])
    assert grid.get_pg("dp") is not None and grid.is_current_rank_in_grid()
    with pytest.raises(KeyError, match="already"):
        grid.create_pg("dp")


def _update_timeout() -> None:
    """update_pg_timeout sets every group's timeout (read where this torch exposes it)."""
    ps.update_pg_timeout(timedelta(seconds=77))
    if default_group_timeout() is not None:
        for name in ("tp", "dp", "expt_dp"):
            backend = ps.get_parallel_state().groups[name]._get_backend(device())  # private: this test only
            assert backend.options._timeout == timedelta(seconds=77), name


def _body(state: ParallelState) -> None:
    rank = dist.get_rank()
    assert ps.model_parallel_is_initialized() and ps.get_parallel_state() is state
    _dense_tp2_pp2(rank)
    _expert_ep2(rank)
    _order_tp_pp_dp(rank)
    _hyper_comm_grid(rank)
    _update_timeout()


def test_megatron_getters_return_the_right_groups() -> None:
    run_distributed(_body, world_size=4, tp=2, pp=2, backend="gloo", timeout_s=90.0)
