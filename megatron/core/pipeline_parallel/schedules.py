"""Forward/backward schedules behind one call, ``get_forward_backward_func()``.

The contract is Megatron-Core's: ``forward_step_func(data_iterator, model)`` returns
``(output_tensor, loss_func)``; ``loss_func(output_tensor)`` returns ``(loss, metrics)`` or
``(loss, num_tokens, metrics)``. The schedule returns the list of per-micro-batch ``metrics`` on the
last pipeline stage and an empty list on the others.

Loss normalisation: with a token count, each micro-batch's loss is divided by its token count and
by ``num_microbatches``; with ``config.calculate_per_token_loss`` it is not divided and
``finalize_model_grads_func`` receives the step's token count to divide the gradients globally
(zero on stages without the loss; ``finalize_model_grads`` takes the last stage's count).

Gradient reduction: every backward but the last one of each model chunk runs under
``config.no_sync_func`` (one callable, or one per chunk), so overlapped data-parallel reduction
fires only during the last backward; ``finalize_model_grads_func`` is called once, at the end.

Schedules: no pipelining (gradient accumulation), 1F1B (warm-up of ``min(pp - rank - 1, M)``
forwards, steady one-forward-one-backward, cool-down) and interleaved 1F1B for virtual chunks
(``interleaved.py``); their common steps are in ``schedule_steps.py``.

Groups: a pipelined schedule communicates over the ``p2p_communicator`` it is given, else over the
pipeline group of ``pg_collection`` (a ParallelState or Megatron-Core's ProcessGroupCollection),
else over the default ParallelState's, read once at the schedule's entry and passed down; the model
chunks' own groups are never consulted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_api import get_virtual_pipeline_model_parallel_world_size
from megatron.core.parallel_state_init import get_parallel_state
from megatron.core.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedule_steps import (  # noqa: F401 - Megatron-Core's names here
    ForwardStepFunc,
    GradSync,
    PipelineGroups,
    ScheduleConfig,
    backward_step,
    check_schedule_options,
    communicator_for,
    deallocate_output_tensor,
    finalize,
    forward_step,
    make_communicator,
    model_config,
    tensor_shape,
    unwrap_model,
)

ModelChunks = torch.nn.Module | list[torch.nn.Module]


def _one_chunk(model: ModelChunks, data_iterator: Any, error: str) -> tuple[torch.nn.Module, Any]:
    """The single model chunk and data iterator of a non-interleaved schedule (lists of one accepted)."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ConfigError(error, params=("virtual_pipeline_model_parallel_size",))
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    return model, data_iterator


# --------------------------------------------------------------------------------------------------
def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Any],
    model: ModelChunks,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Any = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> list[Any]:
    """Gradient accumulation over ``num_microbatches``; gradient reduction is deferred (``no_sync``)
    until the last micro-batch's backward, so overlapped reduction fires only then.

    Takes Megatron-Core's keyword arguments; ``seq_length``, ``micro_batch_size``,
    ``decoder_seq_length``, ``first_val_step``, ``adjust_tensor_shapes_fn``, ``p2p_communicator`` and
    ``pg_collection`` have no effect here (nothing is exchanged between stages).
    """
    check_schedule_options(force_all_reduce)
    model, data_iterator = _one_chunk(
        model,
        data_iterator,
        "virtual pipeline chunks (a list of several model chunks) need pipeline_model_parallel_size > 1",
    )
    config = model_config(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    if isinstance(no_sync, (list, tuple)):
        no_sync = no_sync[0]
    metrics: list[Any] = []
    num_tokens: list[torch.Tensor] = []
    with no_sync():
        for _ in range(num_microbatches - 1):
            loss = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                config,
                forward_only,
                metrics,
                num_tokens,
            )
            if not forward_only:
                backward_step(None, loss, None, config)
    loss = forward_step(
        forward_step_func, data_iterator, model, num_microbatches, config, forward_only, metrics, num_tokens
    )
    if not forward_only:
        backward_step(None, loss, None, config)
    finalize(config, [model], num_tokens, forward_only)
    return metrics


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Any] | None,
    model: ModelChunks,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Any = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> list[Any]:
    """1F1B: ``W = min(pp - rank - 1, M)`` warm-up forwards, ``M - W`` steady forward+backward pairs,
    ``W`` cool-down backwards. At most ``W + 1 <= pp - rank`` micro-batches' activations are live.

    The stages exchange activations through ``p2p_communicator`` (its ``pp_rank`` / ``pp_size`` place
    this rank), else through one over ``pg_collection``'s pipeline group (a ParallelState or a
    ProcessGroupCollection; None: the default ParallelState's).
    """
    check_schedule_options(force_all_reduce)
    model, data_iterator = _one_chunk(
        model, data_iterator, "non-interleaved pipeline schedule expects one model chunk per rank"
    )
    config = model_config(model)
    comm = communicator_for(p2p_communicator, pg_collection, model, config, seq_length, micro_batch_size)
    rank, pp = comm.pp_rank, comm.pp_size
    is_first, is_last = rank == 0, rank == pp - 1
    num_warmup = min(pp - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    sync = GradSync(config, 1, active=not forward_only)
    metrics: list[Any] = []
    num_tokens: list[torch.Tensor] = []
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []

    def run_forward(input_tensor: torch.Tensor | None) -> torch.Tensor:
        return forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            config,
            forward_only,
            metrics,
            num_tokens,
            input_tensor,
            is_last,
        )

    def run_backward(output_grad: torch.Tensor | None, last: bool) -> torch.Tensor | None:
        if last:
            sync.enable()
        input_tensor, output = inputs.pop(0), outputs.pop(0)
        return backward_step(input_tensor, output, output_grad, config)

    for _ in range(num_warmup):
        input_tensor = comm.recv_forward(recv=not is_first)
        output = run_forward(input_tensor)
        comm.send_forward(None if is_last else output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
            deallocate_output_tensor(None if is_last else output)
    input_tensor = comm.recv_forward(recv=not is_first) if num_steady > 0 else None
    input_grad: torch.Tensor | None
    for i in range(num_steady):
        last_iteration = i == num_steady - 1
        output = run_forward(input_tensor)
        if forward_only:
            comm.send_forward(None if is_last else output)
            if not last_iteration:
                input_tensor = comm.recv_forward(recv=not is_first)
            continue
        output_grad = comm.send_forward_recv_backward(None if is_last else output, recv=not is_last)
        inputs.append(input_tensor)
        outputs.append(output)
        deallocate_output_tensor(None if is_last else output)
        input_grad = run_backward(output_grad, last=last_iteration and num_warmup == 0)
        if last_iteration:
            input_tensor = None
            comm.send_backward(None if is_first else input_grad)
        else:
            input_tensor = comm.send_backward_recv_forward(
                None if is_first else input_grad, recv=not is_first
            )
    if not forward_only:
        for i in range(num_warmup):
            output_grad = comm.recv_backward(recv=not is_last)
            input_grad = run_backward(output_grad, last=i == num_warmup - 1)
            comm.send_backward(None if is_first else input_grad)
    sync.enable_all()
    finalize(config, [model], num_tokens, forward_only)
    return metrics if is_last else []


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    schedule_pg_collection: Any = None,
    *,
    vpp_size: int | None = None,
) -> Callable[..., list[Any]]:
    """The schedule for the layout: no pipelining (pp 1), 1F1B (pp > 1) or interleaved 1F1B (vpp > 1).

    Megatron-Core's signature; ``vpp_size`` is our spelling of ``vp_size``. Without sizes they come
    from the default parallel state (``initialize_model_parallel``'s pp and virtual stages), as in
    Megatron-Core. ``schedule_pg_collection`` (multi-module pipelines) must be None.
    """
    if schedule_pg_collection is not None:
        raise ConfigError(
            "get_forward_backward_func(schedule_pg_collection=...) is not supported: multi-module "
            "pipelines are not built; pass None",
            params=("schedule_pg_collection",),
        )
    if vp_size is not None and vpp_size is not None and vp_size != vpp_size:
        raise ConfigError(
            f"vp_size={vp_size} and vpp_size={vpp_size} differ; pass one of them",
            params=("vp_size", "vpp_size"),
        )
    vpp_size = vp_size if vp_size is not None else vpp_size
    if pp_size is None:
        pp_size = get_parallel_state().pp_size
        if vpp_size is None:
            vpp_size = get_virtual_pipeline_model_parallel_world_size()
    if pp_size <= 1:
        if vpp_size is not None and vpp_size > 1:
            raise ConfigError(
                "virtual pipeline stages (virtual_pipeline_model_parallel_size) need "
                "pipeline_model_parallel_size > 1",
                params=("virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"),
            )
        return forward_backward_no_pipelining
    if vpp_size is not None and vpp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
