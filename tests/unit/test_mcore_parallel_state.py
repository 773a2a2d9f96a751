"""Megatron-Core 0.19.2's parallel_state without communication: RankGenerator layouts from its
documented examples, every order, the initialize_model_parallel signature and refusals, and the
getters / setters on a world of one."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest

from megatron.core import parallel_state as ps
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.parallel_state import RankGenerator, make_expert_grid


@pytest.fixture(autouse=True)
def _fresh_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_sixteen_gpu_example_of_initialize_model_parallel_docstring() -> None:
    """tp2 x pp4 on 16 ranks: 8 tp groups, 4 pp groups and 8 dp groups as Megatron documents."""
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_context_parallel_example_of_the_docstring() -> None:
    """8 ranks, tp4 cp2: cp groups [0, 4], [1, 5], [2, 6], [3, 7]."""
    gen = RankGenerator(tp=4, ep=1, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_masked_orthogonal_examples() -> None:
    """The generator's documented cases: tp-pp-dp 2-2-2 dp groups; tp-dp-pp 2-3-4 dp groups."""
    assert RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp").get_ranks("dp") == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    dp = RankGenerator(tp=2, ep=1, dp=3, pp=4, cp=1, order="tp-dp-pp").get_ranks("dp")
    assert dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23] and len(dp) == 8
    assert ps.generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False]) == dp
    assert ps.generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, False, True]) == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]


def _reference_groups(sizes: dict[str, int], order: list[str], token: str) -> list[list[int]]:
    """An independent enumeration: an n-d array of ranks, the token's axes moved last."""
    names = [n for n in order if n in sizes]
    arr = np.arange(int(np.prod([sizes[n] for n in names]))).reshape([sizes[n] for n in reversed(names)])
    rev = list(reversed(names))
    dims = [n for n in rev if n in token.split("-")]
    arr = np.moveaxis(arr, [rev.index(d) for d in dims], list(range(len(rev) - len(dims), len(rev))))
    return arr.reshape(-1, int(np.prod([sizes[d] for d in dims]))).tolist()


@pytest.mark.parametrize("order", ["-".join(p) for p in itertools.permutations(["tp", "cp", "dp", "pp"])])
@pytest.mark.parametrize("token", ["tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-cp", "tp-dp-cp"])
def test_every_order_enumerates_as_megatron(order: str, token: str) -> None:
    sizes = {"tp": 2, "cp": 3, "dp": 2, "pp": 2}
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=3, order=order)
    assert gen.get_ranks(token) == _reference_groups(sizes, order.split("-"), token)


def test_rank_offset_and_appended_axes() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=4)
    assert gen.order == "tp-dp-pp-ep-cp-gtp_remat"
    assert gen.get_ranks("dp") == [[4, 6], [5, 7]]
    assert gen.get_gtp_ranks(1) == [[4], [5], [6], [7]]


def test_order_leaving_out_a_used_axis_is_megatrons_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="pp"):
        RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="not both"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")


def test_expert_grid_is_megatrons_expert_generator() -> None:
    """8 ranks, expert tp 2 x ep 2 x pp 1: the expert generator's groups."""
    grid = make_expert_grid(8, etp=2, ep=2, pp=1)
    gen = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    for token in ("ep", "tp", "dp", "tp-ep", "tp-ep-pp"):
        assert grid.groups(token) == gen.get_ranks(token), token
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        make_expert_grid(8, etp=1, ep=3, pp=1)


def test_hyper_comm_grid_enumerates_as_rank_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "24")
    grid = HyperCommGrid([2, 3, 2, 2], ["tp", "cp", "pp", "dp"])
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=3, order="tp-cp-pp-dp")
    for dims, token in (("dp", "dp"), (["cp", "dp"], "cp-dp"), (["tp", "pp"], "tp-pp"), ("cp", "cp")):
        assert grid.get_rank_enum(dims) == gen.get_ranks(token), dims
    assert HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4).get_rank_enum("dp") == [[4, 6], [5, 7]]
    with pytest.raises(RuntimeError, match="over sized"):
        HyperCommGrid([5, 5], ["tp", "dp"])
    with pytest.raises(KeyError, match="create_pg"):
        grid.get_pg("dp")


# Every parameter of 0.19.2's initialize_model_parallel, with its default.
MEGATRON_SIGNATURE = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "pipeline_model_parallel_comm_backend": None,
    "use_sharp": False,
    "context_parallel_size": 1,
    "hierarchical_context_parallel_sizes": None,
    "hybrid_context_parallel": False,
    "expert_model_parallel_size": 1,
    "gtp_remat_size": 1,
    "expert_gtp_remat_size": 1,
    "num_distributed_optimizer_instances": 1,
    "expert_tensor_parallel_size": None,
    "nccl_communicator_config_path": None,
    "distributed_timeout_minutes": 30,
    "order": "tp-cp-ep-dp-pp",
    "get_embedding_ranks": None,
    "get_position_embedding_ranks": None,
    "create_gloo_process_groups": True,
    "high_priority_stream_groups": None,
    "sharp_enabled_group": None,
    "rank_offset": 0,
    "local_world_size": None,
}


def test_initialize_model_parallel_has_megatrons_signature() -> None:
    params = inspect.signature(ps.initialize_model_parallel).parameters
    assert {n: p.default for n, p in params.items()} == MEGATRON_SIGNATURE
    assert list(params)[:3] == [
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
    ]


def test_arguments_asking_for_what_is_not_built_are_one_error() -> None:
    with pytest.raises(ValueError) as err:
        ps.initialize_model_parallel(
            gtp_remat_size=2, hybrid_context_parallel=True, num_distributed_optimizer_instances=2
        )
    for name in ("gtp_remat_size=2", "hybrid_context_parallel", "num_distributed_optimizer_instances=2"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="pipeline_model_parallel_comm_backend"):
        ps.initialize_model_parallel(pipeline_model_parallel_comm_backend="ucc")
    with pytest.raises(ValueError, match="sharp_enabled_group"):
        ps.initialize_model_parallel(sharp_enabled_group="dp")
    with pytest.raises(ValueError, match="order"):
        ps.initialize_model_parallel(order="tp-xp-dp")
    assert not ps.model_parallel_is_initialized()


def test_tuning_arguments_are_accepted() -> None:
    ps.initialize_model_parallel(
        use_sharp=True,
        nccl_communicator_config_path="/no/such.yaml",
        high_priority_stream_groups=["dp_cp"],
        order="tp-pp-dp",
    )
    assert ps.model_parallel_is_initialized() and ps.is_initialized()


def test_virtual_pipeline_needs_a_pipeline() -> None:
    with pytest.raises(RuntimeError, match="pipeline_model_parallel_size > 1"):
        ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)


def test_getters_on_a_world_of_one() -> None:
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel()
    assert ps.model_parallel_is_initialized()
    sizes = [
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_data_parallel_world_size(),
        ps.get_tensor_and_context_parallel_world_size(),
        ps.get_expert_tensor_and_model_parallel_world_size(),
    ]
    assert sizes == [1] * len(sizes)
    assert ps.get_all_ranks() == "0_0_0_0_0_0"
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group()
    assert ps.get_pipeline_model_parallel_next_rank() == ps.get_pipeline_model_parallel_prev_rank() == 0
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_tensor_model_parallel_src_rank() == ps.get_data_parallel_src_rank() == 0
    assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    with pytest.raises(AssertionError, match="inter distributed optimizer"):
        ps.get_inter_distributed_optimizer_instance_group()
    with pytest.raises(ValueError, match="with_context_parallel"):
        ps.get_data_parallel_group(partial_data_parallel=True)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


def test_setters_override_the_getters_until_destroy() -> None:
    ps.initialize_model_parallel()
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    ps.set_expert_model_parallel_world_size(2)
    assert ps.get_tensor_model_parallel_world_size() == 4 and ps.get_tensor_model_parallel_rank() == 3
    assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    assert ps.get_expert_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.is_pipeline_first_stage()


def test_virtual_stages_decide_first_and_last_stage_unless_ignored() -> None:
    ps.initialize_model_parallel()
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    with pytest.warns(DeprecationWarning):
        ps.set_virtual_pipeline_model_parallel_rank(1)
    assert ps.get_virtual_pipeline_model_parallel_rank() == 1
    assert ps.is_pipeline_first_stage()  # ignore_virtual=True by default
    assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    with pytest.raises(ValueError, match="vp_stage"):
        ps.is_pipeline_last_stage(ignore_virtual=False)


def test_mpu_is_parallel_state() -> None:
    import megatron.core
    import megatron.core.mpu as mpu_module
    from megatron.core import mpu

    assert mpu is ps and mpu_module is ps and megatron.core.parallel_state is ps
    ps.initialize_model_parallel()
    assert mpu.model_parallel_is_initialized()


def test_process_group_collection_fields_and_mpu_groups() -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "dp", "ep"])
    assert pgs.tp is None and pgs.cp is None  # no torch.distributed: no group objects; cp never set
    with pytest.raises(ValueError, match="Invalid process groups"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["xp"])
    with pytest.raises(ValueError, match="no field"):
        ProcessGroupCollection(xp=None)
    sentinel = object()
    assert ProcessGroupCollection(tp=sentinel).tp is sentinel
    with pytest.raises(AttributeError):
        _ = ProcessGroupCollection().no_such_group
