"""Cross entropy over vocab-sharded logits, never materialising the full vocabulary on one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: loss = logsumexp(logits) - logits[target] with max / sum all-reduced over tp.
    Backward: softmax minus one-hot, computed locally on each shard."""

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        local_max = logits.max(dim=-1)[0]
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        local_t = target - start
        outside = (local_t < 0) | (local_t >= v_local)
        local_t = local_t.masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - picked
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss. ``logits`` ``[..., V/tp]`` (any dtype; computed in fp32), ``target`` ``[...]``."""
    if group_size(group) == 1:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group)
