"""Forward/backward schedules behind one call, ``get_forward_backward_func()``.

The contract is Megatron-Core's: ``forward_step_func(data_iterator, model)`` returns
``(output_tensor, loss_func)``; ``loss_func(output_tensor)`` returns ``(loss, metrics)`` or
``(loss, num_tokens, metrics)``. The schedule returns the list of per-micro-batch ``metrics``.

Loss normalisation: with a token count, each micro-batch's loss is divided by its token count and
by ``num_microbatches``; with ``config.calculate_per_token_loss`` it is not divided and
``finalize_model_grads_func`` receives the step's token count to divide the gradients globally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


def _model_config(model):
    module = model[0] if isinstance(model, list) else model
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module.config


def forward_step(forward_step_func: Callable, data_iterator, model, num_microbatches: int, config,
                 forward_only: bool, metrics: list, num_tokens: list):
    """Run one micro-batch forward; returns the (scaled) loss tensor to backpropagate."""
    output_tensor, loss_func = forward_step_func(data_iterator, model)
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


def backward_step(loss: torch.Tensor, config) -> None:
    if config.grad_scale_func is not None:
        loss = config.grad_scale_func(loss)
    loss.backward()


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator | list, model,
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None, decoder_seq_length=None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step=None, adjust_tensor_shapes_fn=None) -> list:
    """Gradient accumulation over ``num_microbatches``; gradient reduction is deferred (``no_sync``)
    until the last micro-batch's backward, so overlapped reduction fires only then."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("virtual pipeline chunks need --pipeline-model-parallel-size > 1")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    config = _model_config(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    metrics: list = []
    num_tokens: list = []
    with no_sync():
        for _ in range(num_microbatches - 1):
            loss = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_only,
                                metrics, num_tokens)
            if not forward_only:
                backward_step(loss, config)
    loss = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_only,
                        metrics, num_tokens)
    if not forward_only:
        backward_step(loss, config)
        if config.finalize_model_grads_func is not None:
            total = torch.stack([t.reshape(()) for t in num_tokens]).sum() if num_tokens else None
            config.finalize_model_grads_func(
                [model], total if config.calculate_per_token_loss else None
            )
    return metrics


def get_forward_backward_func(pp_size: int = 1, vpp_size: int | None = None) -> Callable:
    """The schedule for the layout (pipelined schedules arrive with pipeline parallelism)."""
    if pp_size > 1:
        raise NotImplementedError("pipeline-parallel schedules are not implemented yet")
    return forward_backward_no_pipelining
