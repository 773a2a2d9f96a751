"""Everything that must happen to gradients between the last backward and the optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def finalize_model_grads(model_chunks: list, num_tokens: torch.Tensor | None = None) -> None:
    """1. data-parallel reduction of every chunk's gradient buffer;
    2. with per-token loss, divide gradients by the step's global token count (all-reduced over DP x CP).
    """
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if num_tokens is not None:
        pg = model_chunks[0].pg
        num_tokens = num_tokens.detach().clone().float()
        if pg.dp_cp_group is not None and pg.dp_size * pg.cp_size > 1:
            dist.all_reduce(num_tokens, group=pg.dp_cp_group)
        # The DP reduction above averaged over ranks; the loss sums were per rank, so re-multiply.
        factor = pg.dp_size * pg.cp_size / num_tokens.clamp(min=1)
        for chunk in model_chunks:
            chunk.scale_gradients(factor)
