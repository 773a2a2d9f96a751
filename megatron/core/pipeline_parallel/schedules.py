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
(``interleaved.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.autograd import Variable

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator


def unwrap_model(model):
    """The innermost module (through DDP-style ``.module`` wrappers)."""
    while hasattr(model, "module") and not hasattr(model, "set_input_tensor"):
        model = model.module
    return model


def _one_chunk(model, data_iterator, error: str):
    """The single model chunk and data iterator of a non-interleaved schedule (lists of one accepted)."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(error)
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    return model, data_iterator


def _model_config(model):
    module = model[0] if isinstance(model, list) else model
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module.config


def _stage(model) -> tuple[int, int]:
    """(pp_rank, pp_size) of the rank holding ``model``."""
    pg = unwrap_model(model).pg
    return pg.pp_rank, pg.pp_size


class GradSync:
    """Holds every chunk's ``no_sync`` context open until ``enable(chunk)`` before its last backward."""

    def __init__(self, config, num_chunks: int, active: bool):
        funcs = config.no_sync_func
        if funcs is None or not active:
            funcs = [contextlib.nullcontext] * num_chunks
        elif not isinstance(funcs, (list, tuple)):
            funcs = [funcs] + [contextlib.nullcontext] * (num_chunks - 1)
        self._open: dict[int, contextlib.AbstractContextManager] = {}
        for chunk, func in enumerate(funcs):
            ctx = func()
            ctx.__enter__()
            self._open[chunk] = ctx

    def enable(self, chunk: int = 0) -> None:
        ctx = self._open.pop(chunk, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def enable_all(self) -> None:
        for chunk in list(self._open):
            self.enable(chunk)


def forward_step(forward_step_func: Callable, data_iterator, model, num_microbatches: int, config,
                 forward_only: bool, metrics: list, num_tokens: list, input_tensor: torch.Tensor | None = None,
                 is_last_stage: bool = True) -> torch.Tensor:
    """Run one micro-batch forward on one model chunk.

    Sets ``input_tensor`` (the previous stage's activation, None on the first stage) on the model,
    calls ``forward_step_func``; on the last stage applies the loss function and returns the scaled
    loss to backpropagate (appending to ``metrics`` / ``num_tokens``), elsewhere returns the output
    activation to send on.
    """
    inner = unwrap_model(model)
    if hasattr(inner, "set_input_tensor"):
        inner.set_input_tensor(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor
    result = loss_func(output_tensor)
    if len(result) == 3:
        loss, tokens, metric = result
        num_tokens.append(tokens)
        if not config.calculate_per_token_loss:
            loss = loss / tokens.clamp(min=1)
    else:
        loss, metric = result
    if not config.calculate_per_token_loss:
        loss = loss / num_microbatches
    metrics.append(metric)
    return loss


def backward_step(input_tensor: torch.Tensor | None, output_tensor: torch.Tensor,
                  output_tensor_grad: torch.Tensor | None, config) -> torch.Tensor | None:
    """Backpropagate one micro-batch through one chunk; returns the gradient of its input activation.

    On the last stage ``output_tensor`` is the loss (scaled by ``config.grad_scale_func``) and
    ``output_tensor_grad`` is None. ``output_tensor`` may have been deallocated after it was sent:
    the autograd engine is called directly so its (dummy) shape is not checked against the grad.
    """
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_tensor_grad is None:
        if config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        output_tensor.backward()
    else:
        Variable._execution_engine.run_backward(
            tensors=(output_tensor,), grad_tensors=(output_tensor_grad,), keep_graph=False, create_graph=False,
            inputs=(), allow_unreachable=True, accumulate_grad=True,
        )
    return input_tensor.grad if input_tensor is not None else None


def deallocate_output_tensor(output: torch.Tensor | None) -> None:
    """Free an activation's storage once it has been sent; its ``grad_fn`` (what backward needs) stays.

    Only for tensors that own their storage and whose producing op does not save its own output
    (the residual add that ends a transformer layer does not).
    """
    if output is None or output._base is not None or not output.requires_grad:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def finalize(config, model_chunks: list, num_tokens: list, forward_only: bool) -> None:
    """Call ``finalize_model_grads_func`` once (training only) with the step's token count."""
    if forward_only or config.finalize_model_grads_func is None:
        return
    total = None
    if config.calculate_per_token_loss:
        if num_tokens:
            total = torch.stack([t.reshape(()) for t in num_tokens]).sum()
        else:  # not the last stage: finalize_model_grads takes the last stage's count
            device = next(unwrap_model(model_chunks[0]).parameters()).device
            total = torch.zeros((), device=device)
    config.finalize_model_grads_func(model_chunks, total)


def tensor_shape(model, config, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """Shape of the activations exchanged between stages: ``[s (/tp with SP), mbs, h]``.

    The tp size is the model's process groups' and sequence parallelism the model's own setting (the
    config's sizes may be left at 1, see ``TransformerConfig.check_parallel_sizes``).
    """
    inner = unwrap_model(model)
    tp = inner.pg.tp_size
    sequence_parallel = getattr(inner, "sequence_parallel", getattr(config, "sequence_parallel", False))
    seq = seq_length // tp if sequence_parallel and tp > 1 else seq_length
    return (seq, micro_batch_size, config.hidden_size)


def make_communicator(model, config, seq_length: int | None, micro_batch_size: int | None) -> P2PCommunicator:
    """The p2p communicator of the pipeline holding ``model`` (shapes fixed from the arguments)."""
    if seq_length is None or micro_batch_size is None:
        raise ValueError("pipeline-parallel schedules need seq_length and micro_batch_size (the activation shape)")
    inner = unwrap_model(model)
    pg = inner.pg
    device = next(inner.parameters()).device
    return P2PCommunicator(pg.pp_group, pg.group_ranks["pp"], pg.pp_rank,
                           tensor_shape(model, config, seq_length, micro_batch_size), config.params_dtype, device)


# --------------------------------------------------------------------------------------------------
def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator | list, model,
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None, decoder_seq_length=None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step=None, adjust_tensor_shapes_fn=None,
                                   p2p_communicator: P2PCommunicator | None = None, pg_collection=None,
                                   force_all_reduce: bool | None = False) -> list:
    """Gradient accumulation over ``num_microbatches``; gradient reduction is deferred (``no_sync``)
    until the last micro-batch's backward, so overlapped reduction fires only then.

    Takes Megatron-Core's keyword arguments; ``seq_length``, ``micro_batch_size``,
    ``decoder_seq_length``, ``first_val_step``, ``adjust_tensor_shapes_fn``, ``p2p_communicator`` and
    ``pg_collection`` have no effect here (the model's ParallelState holds the groups), as
    ``check_schedule_options`` says for all schedules.
    """
    check_schedule_options(force_all_reduce)
    model, data_iterator = _one_chunk(model, data_iterator,
                                      "virtual pipeline chunks need --pipeline-model-parallel-size > 1")
    config = _model_config(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    if isinstance(no_sync, (list, tuple)):
        no_sync = no_sync[0]
    metrics: list = []
    num_tokens: list = []
    with no_sync():
        for _ in range(num_microbatches - 1):
            loss = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_only,
                                metrics, num_tokens)
            if not forward_only:
                backward_step(None, loss, None, config)
    loss = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_only,
                        metrics, num_tokens)
    if not forward_only:
        backward_step(None, loss, None, config)
    finalize(config, [model], num_tokens, forward_only)
    return metrics


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator: Iterator | list | None, model, num_microbatches: int,
        seq_length: int | None = None, micro_batch_size: int | None = None, decoder_seq_length=None,
        forward_only: bool = False, collect_non_loss_data: bool = False, first_val_step=None,
        adjust_tensor_shapes_fn=None, p2p_communicator: P2PCommunicator | None = None, pg_collection=None,
        force_all_reduce: bool | None = False) -> list:
    """1F1B: ``W = min(pp - rank - 1, M)`` warm-up forwards, ``M - W`` steady forward+backward pairs,
    ``W`` cool-down backwards. At most ``W + 1 <= pp - rank`` micro-batches' activations are live.

    ``p2p_communicator`` replaces the one built from the model's pipeline group (tests);
    ``pg_collection`` has no effect (the model's ParallelState holds the groups).
    """
    check_schedule_options(force_all_reduce)
    model, data_iterator = _one_chunk(model, data_iterator,
                                      "non-interleaved pipeline schedule expects one model chunk per rank")
    config = _model_config(model)
    rank, pp = _stage(model)
    comm = p2p_communicator or make_communicator(model, config, seq_length, micro_batch_size)
    is_first, is_last = rank == 0, rank == pp - 1
    num_warmup = min(pp - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    sync = GradSync(config, 1, active=not forward_only)
    metrics: list = []
    num_tokens: list = []
    inputs: list = []
    outputs: list = []

    def run_forward(input_tensor):
        out = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_only,
                           metrics, num_tokens, input_tensor, is_last)
        return out

    def run_backward(output_grad, last: bool):
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
            input_tensor = comm.send_backward_recv_forward(None if is_first else input_grad, recv=not is_first)
    if not forward_only:
        for i in range(num_warmup):
            output_grad = comm.recv_backward(recv=not is_last)
            input_grad = run_backward(output_grad, last=i == num_warmup - 1)
            comm.send_backward(None if is_first else input_grad)
    sync.enable_all()
    finalize(config, [model], num_tokens, forward_only)
    return metrics if is_last else []


def check_schedule_options(force_all_reduce: bool | None) -> None:
    """Refuse the Megatron-Core schedule options that are not built (the others are taken as no-ops)."""
    if force_all_reduce:
        raise ValueError("force_all_reduce=True is not supported: gradients are reduced as the DDP config says; "
                         "pass force_all_reduce=False")


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None,
                              schedule_pg_collection=None, *, vpp_size: int | None = None) -> Callable:
    """The schedule for the layout: no pipelining (pp 1), 1F1B (pp > 1) or interleaved 1F1B (vpp > 1).

    Megatron-Core's signature; ``vpp_size`` is our spelling of ``vp_size``. Without sizes they come
    from the default parallel state (``initialize_model_parallel``'s pp and virtual stages), as in
    Megatron-Core. ``schedule_pg_collection`` (multi-module pipelines) must be None.
    """
    if schedule_pg_collection is not None:
        raise ValueError("get_forward_backward_func(schedule_pg_collection=...) is not supported: multi-module "
                         "pipelines are not built; pass None")
    if vp_size is not None and vpp_size is not None and vp_size != vpp_size:
        raise ValueError(f"vp_size={vp_size} and vpp_size={vpp_size} differ; pass one of them")
    vpp_size = vp_size if vp_size is not None else vpp_size
    if pp_size is None:
        from megatron.core import parallel_state

        pp_size = parallel_state.get_parallel_state().pp_size
        if vpp_size is None:
            vpp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size <= 1:
        if vpp_size is not None and vpp_size > 1:
            raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return forward_backward_no_pipelining
    if vpp_size is not None and vpp_size > 1:
        from megatron.core.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving

        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
