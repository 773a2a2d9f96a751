"""Everything that must happen to gradients between the last backward and the optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel


def _allreduce_sequence_parallel_grads(model_chunks: list[DistributedDataParallel]) -> None:
    """Params replicated across tp that saw only this rank's sequence shard (norms, row-parallel
    biases under sequence parallelism) hold partial gradients: sum them over the tp group."""
    pg = model_chunks[0].pg
    if pg.tp_size == 1:
        return
    grads = [
        p.main_grad  # type: ignore[attr-defined]
        for chunk in model_chunks
        for p in chunk.module.parameters()
        if getattr(p, "sequence_parallel", False) and p.requires_grad
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=pg.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _allreduce_embedding_grads(model_chunks: list[DistributedDataParallel]) -> None:
    """Tied word embeddings across pipeline stages: the first stage's ``embedding.word_embeddings``
    and the last stage's output-layer copy receive different partial gradients; sum them over the
    embedding group (first and last stage of this pipeline) so both copies take the same step."""
    pg = model_chunks[0].pg
    if pg.pp_size == 1 or pg.embedding_group is None:
        return
    if pg.pp_rank == 0:
        chunk = model_chunks[0]
    elif pg.pp_rank == pg.pp_size - 1:
        chunk = model_chunks[-1]
    else:
        return
    weight = chunk.tied_weight
    if weight is None or not weight.requires_grad:
        return
    assert getattr(weight, "main_grad", None) is not None, "finish_grad_sync gives every param a main_grad"
    # Distributed optimizer: both stages own the same slice of the weight (its bucket of its own is
    # laid out alike), the only part reduced over data-parallel ranks and read by the optimizer.
    dist.all_reduce(chunk.owned_main_grad(weight), group=pg.embedding_group)


def sync_shared_embedding(model_chunks: list[DistributedDataParallel]) -> None:
    """Copy the first stage's word embedding into the last stage's tied output-layer copy (after
    loading a checkpoint, which stores only the first stage's tensor). Collective over the embedding
    group; a no-op without pipeline parallelism or without tied embeddings."""
    pg = model_chunks[0].pg
    if pg.pp_size == 1 or pg.embedding_group is None or pg.pp_rank not in (0, pg.pp_size - 1):
        return
    weight = (model_chunks[0] if pg.pp_rank == 0 else model_chunks[-1]).tied_weight
    if weight is None:
        return
    with torch.no_grad():
        dist.broadcast(weight.data, src=pg.group_ranks["embedding"][0], group=pg.embedding_group)


def _last_stage_token_count(
    model_chunks: list[DistributedDataParallel], num_tokens: torch.Tensor
) -> torch.Tensor:
    """With pipelining only the last stage computed the loss: broadcast its token count."""
    pg = model_chunks[0].pg
    num_tokens = num_tokens.detach().clone().float()
    if pg.pp_size > 1:
        dist.broadcast(num_tokens, src=pg.group_ranks["pp"][-1], group=pg.pp_group)
    return num_tokens


def finalize_model_grads(
    model_chunks: list[DistributedDataParallel], num_tokens: torch.Tensor | None = None
) -> None:
    """Megatron's order:
    1. data-parallel reduction of every chunk's gradient buffer;
    2. tensor-parallel sum of sequence-parallel parameters' gradients;
    3. sum of the tied embedding's gradients over the first and last pipeline stage;
    4. with per-token loss, divide gradients by the step's global token count (the last stage's
       count, summed over DP x CP).
    """
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks)
    _allreduce_embedding_grads(model_chunks)
    if num_tokens is not None:
        pg = model_chunks[0].pg
        num_tokens = _last_stage_token_count(model_chunks, num_tokens)
        if pg.dp_cp_group is not None and pg.dp_size * pg.cp_size > 1:
            dist.all_reduce(num_tokens, group=pg.dp_cp_group)
        # The DP reduction above averaged over ranks; the loss sums were per rank, so re-multiply.
        factor = pg.dp_size * pg.cp_size / num_tokens.clamp(min=1)
        for chunk in model_chunks:
            chunk.scale_gradients(factor)
