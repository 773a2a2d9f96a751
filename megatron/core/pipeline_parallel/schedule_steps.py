"""The pieces every schedule is made of: one micro-batch's forward and backward on one model chunk,
the deferred gradient synchronisation, the final ``finalize_model_grads_func`` call, and the
pipeline's groups and communicator, resolved once at a schedule's entry point and passed down.

The contract is Megatron-Core's (see ``schedules``): ``forward_step_func(data_iterator, model)``
returns ``(output_tensor, loss_func)``; ``loss_func(output_tensor)`` returns ``(loss, metrics)`` or
``(loss, num_tokens, metrics)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed import ProcessGroup

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_grid import ParallelState
from megatron.core.parallel_state_init import get_parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

# What forward_step_func returns: the chunk's output and, on the last stage, the loss function.
ForwardStepFunc = Callable[
    [Any, torch.nn.Module], tuple[torch.Tensor, Callable[[torch.Tensor], tuple[Any, ...]]]
]


class ScheduleConfig(Protocol):
    """The config fields the schedules read (``TransformerConfig`` / ``ModelParallelConfig`` has them).

    ``no_sync_func``: one context-manager factory, or one per model chunk (None: no deferral);
    ``grad_scale_func``: scales the last stage's loss before backward; ``finalize_model_grads_func``:
    called once per step with the chunks and the step's token count (per-token loss) or None.
    """

    hidden_size: int
    params_dtype: torch.dtype
    calculate_per_token_loss: bool
    no_sync_func: Any  # Callable[[], ContextManager] | list of them | None
    grad_scale_func: Any  # Callable[[Tensor], Tensor] | None
    finalize_model_grads_func: Any  # Callable[[list[Module], Tensor | None], None] | None
    microbatch_group_size_per_virtual_pipeline_stage: int | None  # interleaved only; None: pp


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module (through DDP-style ``.module`` wrappers)."""
    while hasattr(model, "module") and not hasattr(model, "set_input_tensor"):
        model = cast(torch.nn.Module, model.module)
    return model


def model_config(model: torch.nn.Module | list[torch.nn.Module]) -> ScheduleConfig:
    """The ``config`` of the (first) model chunk, through its wrappers."""
    module: Any = model[0] if isinstance(model, list) else model
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module.config  # type: ignore[no-any-return]


def check_schedule_options(force_all_reduce: bool | None) -> None:
    """Refuse the Megatron-Core schedule options that are not built (the others are taken as no-ops)."""
    if force_all_reduce:
        raise ConfigError(
            "force_all_reduce=True is not supported: gradients are reduced as the DDP config says; "
            "pass force_all_reduce=False",
            params=("force_all_reduce",),
        )


# -------------------------------------------------------------------------------- groups, communicator
@dataclass(frozen=True)
class PipelineGroups:
    """What a pipelined schedule communicates over: this rank's pipeline group, its global ranks in
    pipeline order, this rank's position in them, and the tensor-parallel size (which, with sequence
    parallelism, divides the sequence length of the exchanged activations)."""

    pp_group: ProcessGroup | None
    pp_ranks: tuple[int, ...]
    pp_rank: int
    tp_size: int

    @classmethod
    def of(cls, pg_collection: Any) -> PipelineGroups:
        """The groups of ``pg_collection``: our ParallelState, or Megatron-Core's ProcessGroupCollection
        (its ``pp`` and ``tp`` groups); None: the default ParallelState (``initialize_model_parallel``'s),
        which only the schedules' entry points read.

        Raises:
            ConfigError: a collection without a ``pp`` group.
        """
        state = get_parallel_state() if pg_collection is None else pg_collection
        if isinstance(state, ParallelState):
            return cls(
                state.pp_group, tuple(state.group_ranks.get("pp", [state.rank])), state.pp_rank, state.tp_size
            )
        pp_group = getattr(state, "pp", None)
        if pp_group is None:
            raise ConfigError(
                "pg_collection has no pp group: pass a ProcessGroupCollection with pp (and tp) set, "
                "or a ParallelState",
                params=("pg_collection",),
            )
        tp_group = getattr(state, "tp", None)
        return cls(
            pp_group,
            tuple(dist.get_process_group_ranks(pp_group)),
            pp_group.rank(),
            1 if tp_group is None else tp_group.size(),
        )


def tensor_shape(
    model: torch.nn.Module, config: ScheduleConfig, seq_length: int, micro_batch_size: int, tp_size: int
) -> tuple[int, int, int]:
    """Shape of the activations exchanged between stages: ``[s (/cp) (/tp with SP), mbs, h]``.

    ``tp_size`` is the size of the groups the schedule was given; sequence parallelism and the cp
    size (each cp rank holds ``s / cp`` tokens) are the model's own (its ``pg``; the config's sizes
    may be left at 1, see ``TransformerConfig.check_parallel_sizes``).
    """
    inner = unwrap_model(model)
    sequence_parallel = getattr(inner, "sequence_parallel", getattr(config, "sequence_parallel", False))
    cp_size = getattr(getattr(inner, "pg", None), "cp_size", getattr(config, "context_parallel_size", 1))
    seq = seq_length // cp_size
    seq = seq // tp_size if sequence_parallel and tp_size > 1 else seq
    return (seq, micro_batch_size, config.hidden_size)


def make_communicator(
    model: torch.nn.Module,
    config: ScheduleConfig,
    groups: PipelineGroups,
    seq_length: int | None,
    micro_batch_size: int | None,
) -> P2PCommunicator:
    """The p2p communicator over ``groups`` for ``model``'s activations (shapes fixed from the arguments)."""
    if seq_length is None or micro_batch_size is None:
        raise ConfigError(
            "pipeline-parallel schedules need seq_length and micro_batch_size (the activation shape)",
            params=("seq_length", "micro_batch_size"),
        )
    device = next(unwrap_model(model).parameters()).device
    shape = tensor_shape(model, config, seq_length, micro_batch_size, groups.tp_size)
    return P2PCommunicator(
        groups.pp_group, groups.pp_ranks, groups.pp_rank, shape, config.params_dtype, device
    )


def communicator_for(
    p2p_communicator: P2PCommunicator | None,
    pg_collection: Any,
    model: torch.nn.Module,
    config: ScheduleConfig,
    seq_length: int | None,
    micro_batch_size: int | None,
) -> P2PCommunicator:
    """A schedule entry point's communicator: the one given, else one over ``pg_collection``'s
    pipeline group (the default ParallelState's when None)."""
    if p2p_communicator is not None:
        return p2p_communicator
    return make_communicator(model, config, PipelineGroups.of(pg_collection), seq_length, micro_batch_size)


# ------------------------------------------------------------------------------------ one micro-batch
class GradSync:
    """Holds every chunk's ``no_sync`` context open until ``enable(chunk)`` before its last backward."""

    def __init__(self, config: ScheduleConfig, num_chunks: int, active: bool) -> None:
        funcs = config.no_sync_func
        if funcs is None or not active:
            funcs = [contextlib.nullcontext] * num_chunks
        elif not isinstance(funcs, (list, tuple)):
            funcs = [funcs] + [contextlib.nullcontext] * (num_chunks - 1)
        self._open: dict[int, contextlib.AbstractContextManager[Any]] = {}
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


def forward_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: torch.nn.Module,
    num_microbatches: int,
    config: ScheduleConfig,
    forward_only: bool,
    metrics: list[Any],
    num_tokens: list[torch.Tensor],
    input_tensor: torch.Tensor | None = None,
    is_last_stage: bool = True,
) -> torch.Tensor:
    """Run one micro-batch forward on one model chunk.

    Sets ``input_tensor`` (the previous stage's activation, None on the first stage) on the model,
    calls ``forward_step_func``; on the last stage applies the loss function and returns the scaled
    loss to backpropagate (appending to ``metrics`` / ``num_tokens``), elsewhere returns the output
    activation to send on.
    """
    inner: Any = unwrap_model(model)
    if hasattr(inner, "set_input_tensor"):
        inner.set_input_tensor(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if getattr(config, "num_moe_experts", None):
        set_aux_loss_scale(config, num_microbatches, inner, output_tensor.device)
    if not is_last_stage:
        return output_tensor
    result = loss_func(output_tensor)
    if len(result) == 3:
        loss, tokens, metric = result
        num_tokens.append(tokens)
        if not config.calculate_per_token_loss:
            loss = _mean_over_context_parallel(loss, tokens, inner, forward_only)
    else:
        loss, metric = result
    if not config.calculate_per_token_loss:
        loss = loss / num_microbatches
    metrics.append(metric)
    return loss  # type: ignore[no-any-return]


def set_aux_loss_scale(
    config: ScheduleConfig, num_microbatches: int, model: Any, device: torch.device
) -> None:
    """The MoE auxiliary losses' gradient scale for the micro-batch just run forward (read in its
    backward by ``MoEAuxLossAutoScaler``), as the main loss is scaled: 1 / micro-batches, times the cp
    size (the cp ranks' shares of a sequence's loss are averaged with the gradients over dp x cp);
    1 with ``calculate_per_token_loss`` (Megatron-Core's rule); times the fp16 loss scale."""
    cp_size = getattr(getattr(model, "pg", None), "cp_size", 1)
    value = 1.0 if config.calculate_per_token_loss else cp_size / num_microbatches
    scale = torch.full((), value, device=device)  # on the device: backward reads it without a copy
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def _mean_over_context_parallel(
    loss_sum: torch.Tensor, tokens: torch.Tensor, model: Any, forward_only: bool
) -> torch.Tensor:
    """The micro-batch's mean loss from this rank's ``loss_sum`` over its ``tokens``.

    With context parallelism (the model's ``pg`` has a cp group of more than one rank) each cp rank
    holds a slice of the micro-batch's tokens: the sum is divided by the token count of the whole
    micro-batch (one scalar all-reduced over the cp group) and multiplied by the cp size, since the
    gradient reduction averages over dp x cp ranks. The cp ranks' gradients then add up to the
    gradient of the micro-batch's mean, whatever the loss mask leaves on each rank. The count is
    not reduced for ``forward_only`` (the reported metrics carry sums and counts of their own).
    """
    pg: Any = getattr(model, "pg", None)
    cp_size = getattr(pg, "cp_size", 1)
    if pg is None or cp_size == 1 or forward_only:
        return loss_sum / tokens.clamp(min=1)
    total = tokens.detach().clone().float()
    dist.all_reduce(total, group=pg.cp_group)
    return loss_sum * cp_size / total.clamp(min=1)


def backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    config: ScheduleConfig,
) -> torch.Tensor | None:
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
            tensors=(output_tensor,),
            grad_tensors=(output_tensor_grad,),
            keep_graph=False,
            create_graph=False,
            inputs=(),
            allow_unreachable=True,
            accumulate_grad=True,
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


def finalize(
    config: ScheduleConfig,
    model_chunks: list[torch.nn.Module],
    num_tokens: list[torch.Tensor],
    forward_only: bool,
) -> None:
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
