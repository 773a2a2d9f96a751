"""Context parallelism through Megatron-Core's library surface, on 2 gloo ranks (one spawn).

``parallel_state.initialize_model_parallel(context_parallel_size=2)``, ``GPTModel(config,
get_gpt_layer_local_spec(), ...)`` (SelfAttention puts the context-parallel attention in DotProductAttention's slot)
and the batch cut with ``get_batch_on_this_cp_rank``: each rank's per-token losses are the
one-process model's at that rank's positions, and the gradients summed over the cp ranks (what
DDP's reduction over dp x cp does) are the one-process model's, in fp64 with RoPE and GQA, causal
and with a DocumentMask, for each comm type. RotaryEmbedding with the cp group returns the rank's
rows of the whole sequence's angles. Memory: the bytes autograd saves per rank for one long
sequence fall to about half with cp 2, and the estimate's activation figure falls likewise.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from harness import run_distributed

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.transformer.context_parallel.layout import local_token_indices
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

VOCAB, EOD = 64, 0
COMM_TYPES = ("allgather", "p2p")


def _config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope",
        params_dtype=torch.float64,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _model(cfg: TransformerConfig, seq: int, pg: ParallelState | None = None) -> GPTModel:
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=seq, seed=3, parallel_state=pg
    )
    return model.double()


def _batch(b: int, s: int, documents: bool) -> dict:
    """tokens / labels / loss_mask / position_ids ``[b, s]``; with ``documents`` an EOD every few
    tokens (row-dependent) and each document's positions counted from 0."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (b, s), generator=g)
    positions = torch.arange(s).expand(b, s).clone()
    if documents:
        for row in range(b):
            ends = torch.arange(4 + row, s, 5 + 2 * row)
            tokens[row, ends] = EOD
        doc_ids = DocumentMask.from_tokens(tokens, EOD).doc_ids
        starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], 1)
        for row in range(b):
            first = torch.where(starts[row], torch.arange(s), torch.zeros(s, dtype=torch.int64))
            positions[row] = torch.arange(s) - torch.cummax(first, 0).values
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).double()
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions)


def _loss_and_grads(model: GPTModel, batch: dict, mask, num_tokens: torch.Tensor):
    """Per-token losses and the gradients of the masked sum / ``num_tokens`` (the global count)."""
    losses = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / num_tokens
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return losses.detach(), grads


def _check_equals_one_process(ps: ParallelState, comm_type: str, documents: bool) -> None:
    b, s = 2, 32
    cfg = _config(cp_comm_type=comm_type)
    reference = _model(cfg, s, ParallelState(grid=RankGrid(), rank=0))
    model = _model(dataclasses.replace(cfg, context_parallel_size=2), s)
    batch = _batch(b, s, documents)
    mask = DocumentMask.from_tokens(batch["tokens"], EOD) if documents else None
    count = batch["loss_mask"].sum()
    # The reference takes the documents as the dense mask (GPTDataset's --reset-attention-mask mask).
    ref_losses, ref_grads = _loss_and_grads(reference, batch, None if mask is None else mask.dense(), count)

    local = get_batch_on_this_cp_rank(batch)
    assert local["tokens"].shape == (b, s // 2)
    losses, grads = _loss_and_grads(model, local, mask, count)
    mine = local_token_indices(s, ps.cp_size, ps.cp_rank)
    what = f"{comm_type}, {'documents' if documents else 'causal'}"
    torch.testing.assert_close(losses, ref_losses[:, mine], rtol=1e-10, atol=1e-12, msg=what)
    for name, grad in grads.items():
        dist.all_reduce(grad, group=ps.cp_group)
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-9, atol=1e-12, msg=f"{what}: {name}")


def _check_rotary(ps: ParallelState) -> None:
    whole = RotaryEmbedding(8, 1.0, cp_group=None)(16, packed_seq=True)
    mine = RotaryEmbedding(8, 1.0)(16)  # the recorded cp group
    assert torch.equal(mine, whole[local_token_indices(16, 2, ps.cp_rank)])
    assert torch.equal(RotaryEmbedding(8, 1.0)(16, cp_group=ps.cp_group), mine)


def _saved_bytes(model: GPTModel, batch: dict, mask) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    return sum(seen.values())


def _check_memory_falls(ps: ParallelState, comm_type: str) -> dict:
    """Saved bytes of one sequence of 512 tokens on one rank: the whole sequence (cp 1) against this
    rank's half (cp 2)."""
    s = 512
    cfg = _config(num_layers=1, hidden_size=64, ffn_hidden_size=128, cp_comm_type=comm_type)
    batch = _batch(1, s, documents=False)
    whole = _saved_bytes(_model(cfg, s, ParallelState(grid=RankGrid(), rank=0)), batch, None)
    model = _model(dataclasses.replace(cfg, context_parallel_size=2), s)
    half = _saved_bytes(model, get_batch_on_this_cp_rank(batch), None)
    assert half < 0.6 * whole, f"{comm_type}: cp 2 saves {half} bytes per rank, cp 1 {whole}"
    return {"comm_type": comm_type, "cp1": whole, "cp2": half}


def _body(ps: ParallelState) -> list:
    assert ps.cp_size == 2 and parallel_state.get_context_parallel_world_size() == 2
    _check_rotary(ps)
    figures = []
    for comm_type in COMM_TYPES:
        for documents in (False, True):
            _check_equals_one_process(ps, comm_type, documents)
        figures.append(_check_memory_falls(ps, comm_type))
    return figures


def test_context_parallel_gpt_model_equals_one_process_and_saves_half():
    figures = run_distributed(_body, world_size=2, cp=2, backend="gloo", timeout_s=240.0)
    assert len(figures) == 2
