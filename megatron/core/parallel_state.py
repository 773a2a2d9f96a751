"""Megatron-Core's ``parallel_state``: the rank grid, its named process groups, and the getters.

Every rank sits at one coordinate of a grid whose axes are, from fastest to slowest varying,
``tp-cp-ep-dp-pp`` (Megatron's default order; ``initialize_model_parallel(order=...)`` takes the
others Megatron accepts)::

    global_rank = tp_rank + TP * (cp_rank + CP * (ep_rank + EP * (dp_rank + DP * pp_rank)))

A group for a set of axes (for example ``"tp-dp"``) holds the ranks that differ only along those
axes. ``ParallelState`` bundles the groups this rank belongs to, of the dense grid (ep = 1) and of
the expert grid (expert-tp x ep x expert-dp x pp over the same ranks); library classes receive it
(or the one group they need) in their constructor. ``initialize_model_parallel`` builds one and
records it as the default instance, which only public entry points read: the Megatron-named
getters below (``get_tensor_model_parallel_group()``, ...) are such entry points.

The pieces live in ``rank_grid`` (grid arithmetic), ``parallel_state_grid`` (group building), ``parallel_state_init``
(the default instance, kept in the runtime's layout state: ``megatron.core.runtime``) and
``parallel_state_api`` (the getters); this module re-exports them.
"""

from __future__ import annotations

from megatron.core.parallel_state_api import (  # noqa: F401 - re-exported
    destroy_global_memory_buffer,
    get_all_ranks,
    get_amax_reduction_group,
    get_context_parallel_global_ranks,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_group_gloo,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_embedding_group,
    get_expert_data_parallel_group,
    get_expert_data_parallel_group_gloo,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_src_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_group,
    get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_model_pipeline_parallel_group,
    get_expert_tensor_parallel_group,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_global_memory_buffer,
    get_hierarchical_context_parallel_groups,
    get_inter_distributed_optimizer_instance_group,
    get_intra_distributed_optimizer_instance_group,
    get_model_parallel_group,
    get_model_parallel_src_rank,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_position_embedding_group,
    get_tensor_and_context_parallel_group,
    get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size,
    get_tensor_and_data_parallel_group,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_rank_in_embedding_group,
    is_rank_in_position_embedding_group,
    set_data_parallel_rank,
    set_expert_model_parallel_rank,
    set_expert_model_parallel_world_size,
    set_expert_tensor_parallel_rank,
    set_expert_tensor_parallel_world_size,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
    update_pg_timeout,
)
from megatron.core.parallel_state_grid import (  # noqa: F401 - re-exported
    AXES,
    ParallelLayoutError,
    ParallelState,
    RankGenerator,
    RankGrid,
    build_parallel_state,
    default_embedding_ranks,
    default_group_timeout,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
    make_expert_grid,
    make_grid,
    parse_order,
)
from megatron.core.parallel_state_init import (  # noqa: F401 - re-exported
    create_group,
    destroy_model_parallel,
    get_parallel_state,
    initialize_model_parallel,
    is_initialized,
    model_parallel_is_initialized,
)
