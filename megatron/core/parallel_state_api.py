"""Megatron-Core's ``parallel_state`` getters and setters, read from the default ParallelState.

Public entry points for code written against Megatron-Core (``from megatron.core import
parallel_state``); library classes receive a ParallelState instead. Each getter reads the instance
``initialize_model_parallel`` recorded (a one-rank state in a world of one before it is called).
A group getter whose group was not built raises AssertionError when ``check_initialized`` is
true and returns None otherwise, as in Megatron-Core. The setters override what the Megatron-named
getters return (as Megatron's do), not the ParallelState our layers read.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_grid import ParallelState
from megatron.core.parallel_state_init import initialized_state
from megatron.core.runtime import GlobalMemoryBuffer, get_runtime


def _state() -> ParallelState:
    return initialized_state()


def _ovr() -> dict[str, Any]:
    """The values Megatron's setters recorded for the current layout."""
    return get_runtime().layout.overrides


def _group(name: str, check_initialized: bool = True, what: str = "") -> ProcessGroup | None:
    state = _state()
    if name not in state.group_ranks:
        assert not check_initialized, f"{what or name} group is not initialized"
        return None
    return state.groups[name]


def _ranks(name: str) -> list[int]:
    state = _state()
    assert name in state.group_ranks, f"{name} group is not initialized"
    return state.group_ranks[name]


def _size(name: str) -> int:
    return len(_ranks(name))


def _rank(name: str) -> int:
    return _ranks(name).index(_state().rank)


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise ConfigError(
            "partial_data_parallel=True needs with_context_parallel=True (the optimizer's partial "
            "data-parallel groups include context parallelism)",
            params=("partial_data_parallel", "with_context_parallel"),
        )
    return "dp_cp" if with_context_parallel else "dp"


# --- groups -------------------------------------------------------------------------------------
def get_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor x pipeline model-parallel group of this rank."""
    return _group("mp", check_initialized, "model parallel")


def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("tp", check_initialized, "tensor model parallel")


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("pp", check_initialized, "pipeline model parallel")


def get_data_parallel_group(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> ProcessGroup | None:
    """The data-parallel group (with the context-parallel ranks when ``with_context_parallel``).

    ``with_gtp_remat`` has no effect (GTP is not built, so both groups coincide); with one
    distributed-optimizer instance the partial group is the whole one.
    """
    return _group(_dp_name(with_context_parallel, partial_data_parallel), True, "data parallel")


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup | None:
    """The gloo twin of :func:`get_data_parallel_group` (the same group under a gloo backend)."""
    return _group(
        _dp_name(with_context_parallel, partial_data_parallel) + "_gloo", True, "data parallel gloo"
    )


def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("cp", check_initialized, "context parallel")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    state = _state()
    assert not check_initialized or "cp" in state.group_ranks, "context parallel group is not initialized"
    return state.group_ranks.get("cp")


def get_hierarchical_context_parallel_groups(
    check_initialized: bool = True,
) -> list[ProcessGroup | None] | None:
    """The groups of ``hierarchical_context_parallel_sizes``, level 0 (consecutive cp ranks) first;
    AssertionError (or None) when they were not built."""
    groups = _state().hierarchical_cp_groups
    if not groups:
        assert not check_initialized, "hierarchical context parallel groups are not initialized"
        return None
    return groups


def get_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """First and last pipeline stage of this rank's pipeline (or ``get_embedding_ranks``'s choice)."""
    return _group("embedding", check_initialized, "embedding")


def get_position_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("position_embedding", check_initialized, "position embedding")


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> ProcessGroup | None:
    return _group(
        "tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized, "tensor and data parallel"
    )


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("tp_cp", check_initialized, "tensor and context parallel")


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> ProcessGroup | None:
    """The FP8 amax reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp", True, "FP8 amax reduction")
    return get_tensor_and_data_parallel_group(with_context_parallel=with_context_parallel)


def get_expert_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("ep", check_initialized, "expert model parallel")


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("expt_tp", check_initialized, "expert tensor parallel")


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    return _group("tp_ep", check_initialized, "expert tensor and model parallel")


def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True, with_egtp_remat: bool = False
) -> ProcessGroup | None:
    """Expert tensor x expert x pipeline group (``with_egtp_remat`` has no effect: GTP is not built)."""
    return _group("tp_ep_pp", check_initialized, "expert tensor-model-pipeline parallel")


def get_expert_data_parallel_group(
    check_initialized: bool = True, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> ProcessGroup | None:
    """The expert-data-parallel group (the partial group is the whole one: a single optimizer instance)."""
    return _group("expt_dp", check_initialized, "expert data parallel")


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> ProcessGroup | None:
    return _group("expt_dp_gloo", True, "expert data parallel gloo")


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True) -> ProcessGroup | None:
    """Every rank of the (single) distributed-optimizer instance: the whole world."""
    return _group("intra_dist_opt", check_initialized, "intra distributed optimizer instance")


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True) -> ProcessGroup | None:
    """Not built (one optimizer instance): AssertionError, or None when not ``check_initialized``."""
    return _group("inter_dist_opt", check_initialized, "inter distributed optimizer instance")


# --- sizes and ranks ----------------------------------------------------------------------------
def get_tensor_model_parallel_world_size() -> int:
    return _ovr().get("tp_size") or _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _ovr()["tp_rank"] if _ovr().get("tp_rank") is not None else _rank("tp")


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _ovr()["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _ovr()["tp_rank"] = rank


def get_pipeline_model_parallel_world_size() -> int:
    return _ovr().get("pp_size") or _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _ovr()["pp_rank"] if _ovr().get("pp_rank") is not None else _rank("pp")


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _ovr()["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _ovr()["pp_rank"] = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """The virtual stages per pipeline rank given to initialize_model_parallel, or None."""
    return _ovr().get("vpp_size")


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _ovr()["vpp_size"] = world_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _ovr().get("vpp_rank")


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated in Megatron-Core (pass ``vp_stage`` instead); warns as it does."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank is deprecated: pass vp_stage to "
        "is_pipeline_first_stage / is_pipeline_last_stage",
        DeprecationWarning,
        stacklevel=2,
    )
    _ovr()["vpp_rank"] = rank


def get_data_parallel_world_size(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    return _size(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    if _ovr().get("dp_rank") is not None:
        return _ovr()["dp_rank"]
    return _rank(_dp_name(with_context_parallel, partial_data_parallel))


def set_data_parallel_rank(rank: int | None) -> None:
    _ovr()["dp_rank"] = rank


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _ovr().get("ep_size") or _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _ovr()["ep_rank"] if _ovr().get("ep_rank") is not None else _rank("ep")


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    _ovr()["ep_size"] = world_size


def set_expert_model_parallel_rank(rank: int | None) -> None:
    _ovr()["ep_rank"] = rank


def get_expert_tensor_parallel_world_size() -> int:
    return _ovr().get("expt_tp_size") or _size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _ovr()["expt_tp_rank"] if _ovr().get("expt_tp_rank") is not None else _rank("expt_tp")


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    _ovr()["expt_tp_size"] = world_size


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    _ovr()["expt_tp_rank"] = rank


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep")


def get_expert_data_parallel_world_size(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    return _size("expt_dp")


def get_expert_data_parallel_rank(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    return _rank("expt_dp")


# --- stages and source ranks --------------------------------------------------------------------
def _check_vp_stage(ignore_virtual: bool, vp_stage: int | None) -> bool:
    """True when the virtual stage decides (virtual pipelining on and not ignored)."""
    if ignore_virtual or get_virtual_pipeline_model_parallel_world_size() is None:
        return False
    if vp_stage is None:
        raise ConfigError(
            "vp_stage must be passed when virtual pipelining is on (ignore_virtual=False)",
            params=("vp_stage",),
        )
    return True


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """This rank runs the first pipeline stage (and, unless ``ignore_virtual``, ``vp_stage`` is 0)."""
    if _check_vp_stage(ignore_virtual, vp_stage) and vp_stage != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """This rank runs the last pipeline stage (and, unless ``ignore_virtual``, the last virtual one)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if _check_vp_stage(ignore_virtual, vp_stage) and vpp is not None and vp_stage != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """This rank holds word embeddings (first or last stage; unless ``ignore_virtual``, of its chunk)."""
    state = _state()
    ranks = state.group_ranks.get("embedding", [])
    if state.rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if state.rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if state.rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    state = _state()
    return state.rank in state.group_ranks.get("position_embedding", [])


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 of this rank's group."""
    return _ranks("tp")[0]


def get_model_parallel_src_rank() -> int:
    return _ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _ranks(_dp_name(with_context_parallel, False))[0]


def get_expert_model_parallel_src_rank() -> int:
    return _ranks("ep")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """The global rank of the next stage (the last stage's next is the first)."""
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_all_ranks() -> str:
    """``"tp_gtp_dp_cp_pp_ep"`` ranks of this rank joined by underscores (gtp is always 0 here)."""
    ranks = [
        get_tensor_model_parallel_rank(),
        0,
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(r or 0) for r in ranks)


def update_pg_timeout(timeout: timedelta, pg: Any = None) -> None:
    """Set the collective timeout of ``pg``, or of the default group and every group of the default
    ParallelState, after a barrier on it; nothing where this torch cannot change a timeout."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    dist.barrier(pg)
    groups = (
        [pg]
        if pg is not None
        else [None, *{id(g): g for g in _state().groups.values() if g is not None}.values()]
    )
    for group in groups:
        set_timeout(timeout, group)


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """A :class:`megatron.core.runtime.GlobalMemoryBuffer` shared by the process until
    ``destroy_model_parallel`` or :func:`destroy_global_memory_buffer` (made on first use)."""
    layout = get_runtime().layout
    if layout.memory_buffer is None:
        layout.memory_buffer = GlobalMemoryBuffer()
    return layout.memory_buffer


def destroy_global_memory_buffer() -> None:
    get_runtime().layout.memory_buffer = None
