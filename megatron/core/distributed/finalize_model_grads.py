"""Everything that must happen to gradients between the last backward and the optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _allreduce_sequence_parallel_grads(model_chunks: list) -> None:
    """Params replicated across tp that saw only this rank's sequence shard (norms, row-parallel
    biases under sequence parallelism) hold partial gradients: sum them over the tp group."""
    pg = model_chunks[0].pg
    if pg.tp_size == 1:
        return
    grads = [p.main_grad for chunk in model_chunks for p in chunk.module.parameters()
             if getattr(p, "sequence_parallel", False) and p.requires_grad]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=pg.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_model_grads(model_chunks: list, num_tokens: torch.Tensor | None = None) -> None:
    """1. data-parallel reduction of every chunk's gradient buffer;
    2. tensor-parallel sum of sequence-parallel parameters' gradients;
    3. with per-token loss, divide gradients by the step's global token count (summed over DP x CP).
    """
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks)
    if num_tokens is not None:
        pg = model_chunks[0].pg
        num_tokens = num_tokens.detach().clone().float()
        if pg.dp_cp_group is not None and pg.dp_size * pg.cp_size > 1:
            dist.all_reduce(num_tokens, group=pg.dp_cp_group)
        # The DP reduction above averaged over ranks; the loss sums were per rank, so re-multiply.
        factor = pg.dp_size * pg.cp_size / num_tokens.clamp(min=1)
        for chunk in model_chunks:
            chunk.scale_gradients(factor)
