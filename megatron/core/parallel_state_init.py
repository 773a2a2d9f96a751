"""The default ParallelState: ``initialize_model_parallel`` (Megatron-Core's signature) records it,
``destroy_model_parallel`` drops it. Only public entry points read it (``get_parallel_state``).

The default instance, the values Megatron-Core's setters override (``set_tensor_model_parallel_world_size``
and the like) and the virtual-pipeline rank and size live in the runtime's layout state
(:class:`megatron.core.runtime.LayoutState`); the overrides are read by the Megatron-named getters of
``parallel_state_api`` only, never by our layers. ``destroy_model_parallel`` starts a new layout state.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_grid import ParallelLayoutError, ParallelState, build_parallel_state
from megatron.core.runtime import get_runtime


def _refusals(
    pipeline_model_parallel_comm_backend: str | None,
    use_sharp: bool,
    hierarchical_context_parallel_sizes: Any,
    hybrid_context_parallel: bool,
    gtp_remat_size: int,
    expert_gtp_remat_size: int,
    num_distributed_optimizer_instances: int,
    sharp_enabled_group: str | None,
    rank_offset: int,
    local_world_size: int | None,
) -> list[tuple[str, str]]:
    """(parameter, explanation) for each argument asking for something this package does not build."""
    out: list[tuple[str, str]] = []
    if pipeline_model_parallel_comm_backend not in (None, "nccl"):
        out.append(
            (
                "pipeline_model_parallel_comm_backend",
                f"pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r}: pipeline "
                "transfers use the default backend; pass None",
            )
        )
    if hybrid_context_parallel:
        out.append(
            (
                "hybrid_context_parallel",
                "hybrid_context_parallel=True: hybrid data x context parallel "
                "groups are not built; pass False",
            )
        )
    for name, value in (("gtp_remat_size", gtp_remat_size), ("expert_gtp_remat_size", expert_gtp_remat_size)):
        if value != 1:
            out.append((name, f"{name}={value}: weight rematerialisation (GTP) is not built; pass 1"))
    if num_distributed_optimizer_instances != 1:
        out.append(
            (
                "num_distributed_optimizer_instances",
                f"num_distributed_optimizer_instances={num_distributed_optimizer_instances}: partial "
                "distributed-optimizer instances are not built; pass 1",
            )
        )
    if sharp_enabled_group is not None and not use_sharp:
        out.append(
            (
                "sharp_enabled_group",
                f"sharp_enabled_group={sharp_enabled_group!r} is only valid with use_sharp=True; pass None",
            )
        )
    elif sharp_enabled_group not in (None, "dp"):
        out.append(
            (
                "sharp_enabled_group",
                f"sharp_enabled_group={sharp_enabled_group!r}: choose 'dp' "
                "(dp_replica needs num_distributed_optimizer_instances > 1)",
            )
        )
    if rank_offset != 0:
        out.append(("rank_offset", f"rank_offset={rank_offset}: the grid spans the whole world here; pass 0"))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_world_size is not None and local_world_size != world:
        out.append(
            (
                "local_world_size",
                f"local_world_size={local_world_size}: the grid spans the whole world ({world}); pass None",
            )
        )
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
        ConfigError: one error listing every argument that asks for something not built here
            (hybrid context parallelism, GTP, several distributed-optimizer
            instances, a UCC pipeline backend, a grid not spanning the world), a layout that
            does not divide the world, an invalid order, or virtual pipelining with pp == 1 (the
            last ones are also RuntimeErrors, as in Megatron-Core).
    """
    del nccl_communicator_config_path, high_priority_stream_groups  # NCCL tuning: no effect here
    refused = _refusals(
        pipeline_model_parallel_comm_backend,
        use_sharp,
        hierarchical_context_parallel_sizes,
        hybrid_context_parallel,
        gtp_remat_size,
        expert_gtp_remat_size,
        num_distributed_optimizer_instances,
        sharp_enabled_group,
        rank_offset,
        local_world_size,
    )
    if refused:
        raise ConfigError(
            "initialize_model_parallel: " + "; ".join(line for _, line in refused),
            params=tuple(name for name, _ in refused),
        )
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size <= 1:
        raise ParallelLayoutError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
            f"pipeline_model_parallel_size > 1 (got {pipeline_model_parallel_size}); pass None",
            params=("virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"),
        )
    if distributed_timeout_minutes is not None and distributed_timeout_minutes <= 0:
        raise ConfigError(
            f"distributed_timeout_minutes must be > 0 (e.g. 30), got {distributed_timeout_minutes}",
            params=("distributed_timeout_minutes",),
        )
    state = build_parallel_state(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
        timeout=None
        if distributed_timeout_minutes is None
        else timedelta(minutes=distributed_timeout_minutes),
        order=order,
        embedding_ranks=get_embedding_ranks,
        position_embedding_ranks=get_position_embedding_ranks,
        gloo_groups=create_gloo_process_groups,
        hierarchical_cp=hierarchical_context_parallel_sizes,
    )
    layout = get_runtime().layout
    layout.overrides.clear()
    if virtual_pipeline_model_parallel_size is not None:
        layout.overrides.update(vpp_rank=0, vpp_size=virtual_pipeline_model_parallel_size)
    layout.parallel_state, layout.initialized = state, True
    return state


def get_parallel_state() -> ParallelState:
    """The default instance; builds a trivial one-rank state when none was initialised (that state
    does not count as initialised for ``model_parallel_is_initialized``)."""
    layout = get_runtime().layout
    if layout.parallel_state is None:
        layout.parallel_state = build_parallel_state()
    return layout.parallel_state


def initialized_state() -> ParallelState:
    """The default instance for Megatron's getters: the recorded one, or a one-rank state where the
    world has one rank. In a larger world before ``initialize_model_parallel`` this is an error
    (building groups lazily there would be a collective only one caller enters)."""
    if (
        not get_runtime().layout.initialized
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        raise RuntimeError(
            "the model-parallel groups are not initialized: call "
            "parallel_state.initialize_model_parallel(...) on every rank first"
        )
    return get_parallel_state()


def model_parallel_is_initialized() -> bool:
    """True after ``initialize_model_parallel`` and until ``destroy_model_parallel``."""
    return get_runtime().layout.initialized


def is_initialized() -> bool:
    """Megatron-Core's other spelling of :func:`model_parallel_is_initialized`."""
    return get_runtime().layout.initialized


def destroy_model_parallel() -> None:
    """Forget the layout: the default instance, the setters' overrides, the virtual-pipeline state,
    the RNG tracker not yet bound to a state, the warmed-up pipeline groups and the global memory
    buffer (a new :class:`megatron.core.runtime.LayoutState`).

    The groups themselves stay valid for whoever holds them; ``dist.destroy_process_group`` ends them.
    """
    get_runtime().reset_layout()


def create_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> Any:
    """``torch.distributed.new_group`` as Megatron-Core calls it (every rank must call it)."""
    return dist.new_group(
        ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
