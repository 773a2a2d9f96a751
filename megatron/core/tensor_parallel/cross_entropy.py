"""Cross entropy over vocab-sharded logits, never materialising the full vocabulary on one rank.

Rank ``r`` of the tp group holds logits ``[..., V/tp]`` for the vocabulary range
``[r*V/tp, (r+1)*V/tp)``. Per token, with ``m`` the global max and ``z = logits - m``::

    loss = log(sum_j exp(z_j)) - z_target                                  (label_smoothing = 0)
    loss = (1 - eps) * that + eps * (log(sum_j exp(z_j)) - mean_j z_j)      (label_smoothing = eps)

which is exactly ``F.cross_entropy(..., label_smoothing=eps)``. Communication per call: an
all-reduce MAX of ``[...]`` and two all-reduce SUMs of ``[...]`` (three with smoothing, stacked
into two). The gradient ``softmax - ((1 - eps) * onehot + eps / V)`` is computed locally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import ProcessGroup, default_tp_group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss, with max / target logit / sum-exp all-reduced over tp.
    Backward: softmax minus the smoothed one-hot, computed locally on each shard (no communication)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        label_smoothing: float,
    ) -> torch.Tensor:
        logits = logits.float()  # [..., V/tp]
        local_max = logits.max(dim=-1)[0]
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        vocab_size = v_local * group_size(group)
        local_t = target - group_rank(group) * v_local
        outside = (local_t < 0) | (local_t >= v_local)
        local_t = local_t.masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        if label_smoothing > 0.0:
            sums = torch.stack([picked, shifted.sum(dim=-1)])
            dist.all_reduce(sums, group=group)
            picked, sum_shifted = sums[0], sums[1]
        else:
            dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        log_z = sum_exp.log()
        loss = log_z - picked
        if label_smoothing > 0.0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_shifted / vocab_size)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_t, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = grad_loss.unsqueeze(-1)
        grad = softmax * g  # a new tensor: the saved softmax stays intact for a repeated backward
        if eps > 0.0:
            grad.sub_(g * (eps / ctx.vocab_size))
        hit = (~outside).unsqueeze(-1).to(grad.dtype) * g * (1.0 - eps)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit)
        return grad, None, None, None


def sharded_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits over an explicit group (the library's form).

    Args:
        logits: ``[..., V/tp]`` this rank's vocabulary block (any float dtype; computed in fp32).
        target: ``[...]`` global token ids in ``[0, V)``.
        group: the tensor-parallel group (``None``: one rank, plain ``F.cross_entropy``).
        label_smoothing: as ``F.cross_entropy``'s ``label_smoothing``.

    Returns:
        ``[...]`` fp32 losses, identical on every tp rank.

    Raises:
        ValueError: ``label_smoothing`` is outside ``[0, 1)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(
            f"label_smoothing must be in [0, 1), got {label_smoothing}", params=("label_smoothing",)
        )
    if group_size(group) == 1:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(
            flat, target.reshape(-1), reduction="none", label_smoothing=label_smoothing
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing)


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Megatron-Core's entry point: :func:`sharded_cross_entropy` where an omitted ``tp_group`` is the
    default ParallelState's tp group (after ``initialize_model_parallel(tp)``, the logits are this
    rank's ``V/tp`` block; before it, one rank holding the whole vocabulary).

    Args:
        vocab_parallel_logits: ``[s, b, V/tp]`` (any leading shape).
        target: ``[s, b]`` global token ids.
        label_smoothing: in ``[0, 1)``; 0 is no smoothing.
        tp_group: the group the vocabulary is split over; default the default tp group.
    """
    return sharded_cross_entropy(vocab_parallel_logits, target, default_tp_group(tp_group), label_smoothing)
