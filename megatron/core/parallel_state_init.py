"""The default ParallelState: ``initialize_model_parallel`` (Megatron-Core's signature) records it,
``destroy_model_parallel`` drops it. Only public entry points read it (``get_parallel_state``).

Besides the default instance this module holds the values Megatron-Core's setters override
(``set_tensor_model_parallel_world_size`` and the like) and the virtual-pipeline rank and size;
they are read by the Megatron-named getters of ``parallel_state_api`` only, never by our layers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron.core.parallel_state_grid import ParallelLayoutError, ParallelState, build_parallel_state

_DEFAULT: ParallelState | None = None
_INITIALIZED = False
# Values set through Megatron's setters ("tp_size", "tp_rank", "pp_size", ...), and the
# virtual-pipeline "vpp_rank" / "vpp_size"; cleared by destroy_model_parallel.
_OVERRIDES: dict[str, Any] = {}


def _refusals(
    pipeline_model_parallel_comm_backend: str | None, use_sharp: bool, hierarchical_context_parallel_sizes: Any,
    hybrid_context_parallel: bool, gtp_remat_size: int, expert_gtp_remat_size: int,
    num_distributed_optimizer_instances: int, sharp_enabled_group: str | None, rank_offset: int,
    local_world_size: int | None,
) -> list[str]:
    """One line per argument asking for something this package does not build."""
    out = []
    if pipeline_model_parallel_comm_backend not in (None, "nccl"):
        out.append(f"pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r}: pipeline "
                   "transfers use the default backend; pass None")
    if hierarchical_context_parallel_sizes:
        out.append("hierarchical_context_parallel_sizes: hierarchical context parallelism is not built; pass None")
    if hybrid_context_parallel:
        out.append("hybrid_context_parallel=True: hybrid data x context parallel groups are not built; pass False")
    for name, value in (("gtp_remat_size", gtp_remat_size), ("expert_gtp_remat_size", expert_gtp_remat_size)):
        if value != 1:
            out.append(f"{name}={value}: weight rematerialisation (GTP) is not built; pass 1")
    if num_distributed_optimizer_instances != 1:
        out.append(f"num_distributed_optimizer_instances={num_distributed_optimizer_instances}: partial "
                   "distributed-optimizer instances are not built; pass 1")
    if sharp_enabled_group is not None and not use_sharp:
        out.append(f"sharp_enabled_group={sharp_enabled_group!r} is only valid with use_sharp=True; pass None")
    elif sharp_enabled_group not in (None, "dp"):
        out.append(f"sharp_enabled_group={sharp_enabled_group!r}: choose 'dp' (dp_replica needs "
                   "num_distributed_optimizer_instances > 1)")
    if rank_offset != 0:
        out.append(f"rank_offset={rank_offset}: the grid spans the whole world here; pass 0")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_world_size is not None and local_world_size != world:
        out.append(f"local_world_size={local_world_size}: the grid spans the whole world ({world}); pass None")
    return out


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int | None = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[..., list[int]] | None = None,
    get_position_embedding_ranks: Callable[..., list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    rank_offset: int = 0,
    local_world_size: int | None = None,
) -> ParallelState:
    """Build the dense and expert groups and record them as the default instance.

    The Megatron-Core entry point, with its arguments and defaults. The dense grid is
    tp x cp x dp x pp, the expert grid expert-tp x ep x expert-dp x pp over the same ranks, both in
    ``order`` (fastest first; any arrangement of tp, cp, ep, dp, pp; axes left out must have size 1;
    when pp is not last the dense and expert dp sizes must be equal).

    ``distributed_timeout_minutes``: every group's collective timeout (30, as in Megatron-Core);
    None: the default group's, so that ``init_process_group(timeout=...)`` holds for every group.
    ``use_sharp``, ``nccl_communicator_config_path`` and ``high_priority_stream_groups`` tune NCCL
    communicators and have no effect here. ``create_gloo_process_groups``: build the gloo twins of
    the data-parallel groups (the same groups under a gloo default backend).

    Returns the recorded ParallelState (Megatron-Core returns None).

    Raises:
        ValueError: one error listing every argument that asks for something not built here
            (hierarchical or hybrid context parallelism, GTP, several distributed-optimizer
            instances, a UCC pipeline backend, a grid not spanning the world), a layout that
            does not divide the world, an invalid order, or virtual pipelining with pp == 1 (the
            last ones are also RuntimeErrors, as in Megatron-Core).
    """
    del nccl_communicator_config_path, high_priority_stream_groups  # NCCL tuning: no effect here
    refused = _refusals(pipeline_model_parallel_comm_backend, use_sharp, hierarchical_context_parallel_sizes,
                        hybrid_context_parallel, gtp_remat_size, expert_gtp_remat_size,
                        num_distributed_optimizer_instances, sharp_enabled_group, rank_offset, local_world_size)
    if refused:
        raise ValueError("initialize_model_parallel: " + "; ".join(refused))
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size <= 1:
        raise ParallelLayoutError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
            f"pipeline_model_parallel_size > 1 (got {pipeline_model_parallel_size}); pass None")
    if distributed_timeout_minutes is not None and distributed_timeout_minutes <= 0:
        raise ValueError(f"distributed_timeout_minutes must be > 0, got {distributed_timeout_minutes}")
    state = build_parallel_state(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
        timeout=None if distributed_timeout_minutes is None else timedelta(minutes=distributed_timeout_minutes),
        order=order,
        embedding_ranks=get_embedding_ranks,
        position_embedding_ranks=get_position_embedding_ranks,
        gloo_groups=create_gloo_process_groups,
    )
    global _DEFAULT, _INITIALIZED
    _OVERRIDES.clear()
    if virtual_pipeline_model_parallel_size is not None:
        _OVERRIDES.update(vpp_rank=0, vpp_size=virtual_pipeline_model_parallel_size)
    _DEFAULT, _INITIALIZED = state, True
    return state


def get_parallel_state() -> ParallelState:
    """The default instance; builds a trivial one-rank state when none was initialised (that state
    does not count as initialised for ``model_parallel_is_initialized``)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = build_parallel_state()
    return _DEFAULT


def initialized_state() -> ParallelState:
    """The default instance for Megatron's getters: the recorded one, or a one-rank state where the
    world has one rank. In a larger world before ``initialize_model_parallel`` this is an error
    (building groups lazily there would be a collective only one caller enters)."""
    if not _INITIALIZED and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("the model-parallel groups are not initialized: call "
                           "parallel_state.initialize_model_parallel(...) on every rank first")
    return get_parallel_state()


def model_parallel_is_initialized() -> bool:
    """True after ``initialize_model_parallel`` and until ``destroy_model_parallel``."""
    return _INITIALIZED


def is_initialized() -> bool:
    """Megatron-Core's other spelling of :func:`model_parallel_is_initialized`."""
    return _INITIALIZED


def destroy_model_parallel() -> None:
    """Forget the default instance, the setters' overrides and the virtual-pipeline state.

    The groups themselves stay valid for whoever holds them; ``dist.destroy_process_group`` ends them.
    """
    global _DEFAULT, _INITIALIZED
    _DEFAULT, _INITIALIZED = None, False
    _OVERRIDES.clear()


def create_group(ranks: list[int] | None = None, timeout: timedelta | None = None, backend: str | None = None,
                 pg_options: Any = None, use_local_synchronization: bool = False,
                 group_desc: str | None = None) -> Any:
    """``torch.distributed.new_group`` as Megatron-Core calls it (every rank must call it)."""
    return dist.new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                          use_local_synchronization=use_local_synchronization, group_desc=group_desc)

