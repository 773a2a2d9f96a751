"""Megatron-Core's activation recompute entry points over the default RNG tracker.

``checkpoint(function, distribute_saved_activations, *args)`` is :func:`random.checkpoint_with_rng`
with the default tracker, or (``distribute_saved_activations=True``) keeps only this tp rank's 1-D
block of the first argument until backward. ``CheckpointWithoutOutput`` also frees the function's
outputs and recomputes them when a chosen tensor's gradient is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from megatron.core.tensor_parallel.mappings import default_tp_group, group_size
from megatron.core.tensor_parallel.rng_api import (
    RngSnapshot,
    callable_name,
    capture_rng,
    detached_like,
    get_cuda_rng_tracker,
    grads_of,
    replaying_rng,
)
from megatron.core.tensor_parallel.rng_states import RNGStatesTracker, checkpoint_with_rng
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks


class _DistributedCheckpoint(torch.autograd.Function):
    """Forward: ``run_function(*args)`` without a graph; saves this tp rank's 1-D block of ``args[0]``
    and the other tensor arguments. Backward: all-gather ``args[0]`` over tp, replay the RNG,
    recompute with a graph, backpropagate."""

    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        tracker: RNGStatesTracker,
        group: ProcessGroup | None,
        *args: Any,
    ) -> Any:
        ctx.run_function, ctx.tracker, ctx.group = run_function, tracker, group
        ctx.rng = capture_rng(tracker)
        outputs = run_function(*args)
        first = args[0]
        ctx.first_shape, ctx.arg_requires_grad = (
            first.shape,
            [isinstance(a, torch.Tensor) and a.requires_grad for a in args],
        )
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        shard = split_tensor_into_1d_equal_chunks(first.detach(), new_buffer=True, tp_group=group)
        ctx.save_for_backward(shard, *[a for a in args[1:] if isinstance(a, torch.Tensor)])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        shard, *rest = ctx.saved_tensors
        tensors = iter([gather_split_1d_tensor(shard, ctx.group).view(ctx.first_shape), *rest])
        args = tuple(next(tensors) if c is None else c for c in ctx.constants)
        inputs = tuple(
            a.detach().requires_grad_(rg) if isinstance(a, torch.Tensor) else a
            for a, rg in zip(args, ctx.arg_requires_grad)
        )
        with replaying_rng(ctx.rng, ctx.tracker), torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        return (None, None, None, *grads_of(outputs, grads, inputs))


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Megatron-Core's activation checkpointing: ``function(*args)`` (the bool is not passed to it),
    its activations recomputed in backward with every generator and the default tracker's named
    states (:func:`get_cuda_rng_tracker`) replayed, so dropout draws the same masks.

    Args:
        distribute_saved_activations: keep only this tp rank's ``1/tp`` 1-D block of ``args[0]`` (a
            tensor) until backward, all-gathered over the default tp group there; no effect at tp 1.

    Raises:
        TypeError: ``distribute_saved_activations`` is not a bool (the old call shape
            ``checkpoint(fn, x)``).
        ValueError: distributing with a first argument that is not a tensor of a size divisible by tp.
    """
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError(
            f"checkpoint(function, distribute_saved_activations, *args): the second argument must "
            f"be a bool, got {type(distribute_saved_activations).__name__}; to checkpoint "
            f"{callable_name(function)}(x) call checkpoint(function, False, x)"
        )
    tracker = get_cuda_rng_tracker()
    group = default_tp_group(None)
    if not distribute_saved_activations or group_size(group) == 1:
        return checkpoint_with_rng(function, *args, tracker=tracker)
    if not args or not isinstance(args[0], torch.Tensor):
        raise ValueError(
            "checkpoint(..., distribute_saved_activations=True, *args): args[0] must be a tensor "
            "(the activation split across the tp group)"
        )
    return _DistributedCheckpoint.apply(function, tracker, group, *args)


class _WithoutOutput(torch.autograd.Function):
    """Forward: ``run_function(*args)`` without a graph. Backward: the owner's recomputed outputs,
    made by its hook, are backpropagated."""

    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], owner: CheckpointWithoutOutput, *args: Any
    ) -> Any:
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*detached_like(tuple(a for a in args if isinstance(a, torch.Tensor))))
        owner.ctx = ctx
        return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if getattr(ctx, "outputs", None) is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: the outputs were not recomputed before their gradient "
                "was needed; call discard_output_and_register_recompute(hook_tensor) with a "
                "tensor whose gradient is computed before the outputs are used in backward"
            )
        inputs, outputs = ctx.inputs, ctx.outputs
        ctx.inputs = ctx.outputs = None
        return (None, None, *grads_of(outputs, grads, inputs))


class CheckpointWithoutOutput:
    """Checkpoint a function and also free its outputs until backward.

    ``checkpoint(run_function, *args)`` runs the function without keeping its activations and records
    every generator's state (the default tracker's too). The caller then uses the outputs in the
    forward (typically only as saved inputs of the next op) and calls
    ``discard_output_and_register_recompute(hook_tensor)``: the outputs' storage is freed (their
    shapes kept) and, when ``hook_tensor``'s gradient is computed in backward, the function is
    recomputed and its values written back into the same tensors, before the ops that saved them
    run their backward. ``hook_tensor`` must be one whose gradient is computed before that.

    Args:
        fp8: accepted for Megatron-Core's signature; no FP8 recompute context here.
    """

    def __init__(self, fp8: bool = False) -> None:
        self.fp8 = fp8
        self.run_function: Callable[..., Any] | None = None
        self.ctx: Any = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._sizes: list[int] = []
        self._tracker: RNGStatesTracker | None = None
        self._rng: RngSnapshot | None = None

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """``run_function(*args)``, its graph not kept; the outputs as the function returns them."""
        self.run_function = run_function
        self._tracker = get_cuda_rng_tracker()
        self._rng = capture_rng(self._tracker)
        outputs = _WithoutOutput.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage and recompute them when ``hook_tensor``'s gradient is computed."""
        if self.outputs is None:
            raise RuntimeError("CheckpointWithoutOutput: call checkpoint(run_function, *args) first")
        self._sizes = [o.untyped_storage().nbytes() for o in self.outputs]
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad: torch.Tensor) -> None:
        if self.ctx is None or self.outputs is None or self.run_function is None:
            return  # already recomputed
        ctx = self.ctx
        assert self._rng is not None and self._tracker is not None, "set by checkpoint()"
        saved = iter(ctx.saved_tensors)
        args = tuple(next(saved) if c is None else c for c in ctx.constants)
        inputs = detached_like(args)
        with replaying_rng(self._rng, self._tracker), torch.enable_grad():
            outputs = self.run_function(*inputs)
        fresh = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for output, value, nbytes in zip(self.outputs, fresh, self._sizes):
                output.untyped_storage().resize_(nbytes)
                # An alias on the same storage: writing through it leaves the version counter of the
                # tensor that later ops saved untouched, so autograd accepts the refilled values.
                alias = output.new_empty(0).set_(
                    output.untyped_storage(), output.storage_offset(), output.size(), output.stride()
                )
                alias.copy_(value)
        ctx.inputs, ctx.outputs = inputs, fresh
        self.ctx, self.outputs, self.run_function = None, None, None
