"""The rank grid without communication: rank <-> coordinates and group membership (reference 7.1)."""

from __future__ import annotations

import itertools

import pytest

from megatron.core.parallel_state import AXES, RankGrid, build_parallel_state, make_grid


def test_sixteen_gpu_example_of_the_reference() -> None:
    grid = make_grid(16, tp=2, pp=4)
    assert grid.sizes() == {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 4}
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("tp-pp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert grid.groups("tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert grid.coords(13) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 3}


GRIDS = [
    RankGrid(),
    RankGrid(tp=2, dp=2),
    RankGrid(tp=4),
    RankGrid(dp=4),
    RankGrid(pp=2, dp=2),
    RankGrid(tp=2, cp=2, dp=2),
    RankGrid(tp=2, cp=2, ep=2, dp=1, pp=2),
    RankGrid(tp=3, dp=2, pp=2),
]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_rank_formula_and_round_trip(grid: RankGrid) -> None:
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        assert all(0 <= c[a] < getattr(grid, a) for a in AXES)
        expected = c["tp"] + grid.tp * (
            c["cp"] + grid.cp * (c["ep"] + grid.ep * (c["dp"] + grid.dp * c["pp"]))
        )
        assert expected == rank
        assert grid.rank(c) == rank


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("axes", ["tp", "cp", "dp", "pp", "tp-pp", "cp-dp", "tp-dp", "tp-cp-dp"])
def test_groups_partition_the_world_along_their_axes(grid: RankGrid, axes: str) -> None:
    varying = axes.split("-")
    groups = grid.groups(axes)
    size = 1
    for a in varying:
        size *= getattr(grid, a)
    assert all(len(g) == size and g == sorted(g) for g in groups)
    assert sorted(itertools.chain(*groups)) == list(range(grid.world_size))  # a partition
    for g in groups:
        coords = [grid.coords(r) for r in g]
        for a in AXES:  # members agree on every axis outside the group
            if a not in varying:
                assert len({c[a] for c in coords}) == 1
        assert len({tuple(c[a] for a in varying) for c in coords}) == size  # and differ inside it


def test_single_axis_groups_are_ordered_by_that_axis() -> None:
    grid = RankGrid(tp=2, cp=2, dp=2, pp=2)
    for g in grid.groups("dp"):
        assert [grid.coords(r)["dp"] for r in g] == [0, 1]
    for g in grid.groups("pp"):
        assert [grid.coords(r)["pp"] for r in g] == [0, 1]


def test_error_names_every_degree() -> None:
    with pytest.raises(ValueError) as err:
        make_grid(12, tp=4, pp=2, cp=1, ep=1)
    msg = str(err.value)
    for needle in (
        "12",
        "tensor_model_parallel_size (4)",
        "pipeline_model_parallel_size (2)",
        "context_parallel_size (1)",
        "expert_model_parallel_size (1)",
        "= 8",
    ):
        assert needle in msg, msg


@pytest.mark.parametrize("flag", ["tp", "pp", "cp", "ep"])
def test_non_positive_degree_is_an_error(flag: str) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        make_grid(4, **{flag: 0})


def test_unknown_axis_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown parallel axis"):
        RankGrid(tp=2).groups("tp-xp")


def test_single_process_state_without_torch_distributed() -> None:
    ps = build_parallel_state()
    assert (ps.tp_size, ps.pp_size, ps.dp_size, ps.cp_size) == (1, 1, 1, 1)
    assert (ps.tp_rank, ps.pp_rank, ps.dp_rank) == (0, 0, 0)
    assert ps.tp_group is None and ps.group_ranks["tp"] == [0]
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
