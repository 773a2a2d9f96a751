"""The GPT-specific pieces of ``pretrain``: tokenizer, model, batches, loss and data iterators."""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.execution_plan import ExecutionPlan
from megatron.core.fusions.fp8 import AmaxReducer
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.data import broadcast_batch
from megatron.core.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.core.transformer.context_parallel.layout import slice_for_cp
from megatron.core.transformer.document_mask import DocumentMask
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.datasets.provider import build_train_valid_test_datasets
from megatron.training.loop_utils import print_rank_0


def tokenizer_provider(cfg, pg):
    """The tokenizer and the padded vocabulary size (a multiple of divisible-by x tp)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.tokenizer.padded_vocab_size:
        return tokenizer, cfg.tokenizer.padded_vocab_size
    if not cfg.tokenizer.pad_vocab_size:
        if tokenizer.vocab_size % pg.tp_size:
            raise ConfigError(
                f"--no-pad-vocab-size: the vocabulary of {tokenizer.vocab_size} tokens does not split "
                f"over --tensor-model-parallel-size {pg.tp_size}; drop --no-pad-vocab-size"
            )
        return tokenizer, tokenizer.vocab_size
    return tokenizer, vocab_size_with_padding(
        tokenizer.vocab_size, cfg.training.make_vocab_size_divisible_by, pg.tp_size, log=print_rank_0
    )


def model_provider(
    cfg,
    padded_vocab_size: int,
    pg,
    device,
    plan: ExecutionPlan | None = None,
    amax_reducer: AmaxReducer | None = None,
) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving), built
    with ``plan``'s implementations (default: ``ExecutionPlan.plain``, the torch code).

    Chunk ``c`` of pipeline rank ``r`` builds the layers of virtual stage ``c * pp + r``; the first
    virtual stage owns the embedding (``pre_process``), the last the output layer and loss.
    ``amax_reducer``: delayed FP8 scaling's amax reduction, owned by the trainer.
    """
    m = cfg.model
    plan = ExecutionPlan.plain(m, pg.tp_size) if plan is None else plan
    spec = get_gpt_decoder_block_plan_spec(plan, amax_reducer)
    vpp = m.virtual_pipeline_model_parallel_size or 1
    layout = m.pipeline_layout(pg.pp_size, vpp)
    chunks = []
    for c in range(vpp):
        chunks.append(
            GPTModel(
                config=m,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size,
                execution_plan=plan,
                max_sequence_length=cfg.training.max_position_embeddings,
                parallel_state=pg,
                device=device,
                seed=cfg.training.seed,
                sequence_parallel=m.sequence_parallel,
                pre_process=pg.pp_rank == 0 and c == 0,
                post_process=pg.pp_rank == pg.pp_size - 1 and c == vpp - 1,
                num_layers=layout.num_layers_of(pg.pp_rank, c),
                layer_offset=layout.offset_of(pg.pp_rank, c),
            )
        )
    return chunks


# Keys each pipeline role reads (Megatron's get_batch: nothing on middle stages).
FIRST_STAGE_KEYS = ("tokens", "position_ids")
LAST_STAGE_KEYS = ("labels", "loss_mask")
DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
}


# Where the attention mask of a batch comes from (``attention_mask_source``).
CAUSAL, DOCUMENTS = "causal", "documents"


def attention_mask_source(data_cfg) -> str:
    """``causal``: no mask (the plain causal mask is the model's fused causal attention, so it is
    never built, broadcast or passed); ``documents`` (--reset-attention-mask): a ``DocumentMask``
    built on the device from the full sequence's tokens, which the attention turns into
    variable-length (or per-block) masking; no dense ``[s, s]`` mask is read from the loader or
    built, whatever --create-attention-mask-in-dataloader says."""
    return DOCUMENTS if data_cfg.reset_attention_mask else CAUSAL


def document_attention_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """GPTDataset's --reset-attention-mask mask for a batch: ``[b, 1, s, s]`` bool, True = masked,
    causal and with no attention across an end-of-document token. ``tokens`` is ``[b, s]``. The
    trainer never builds it (``DocumentMask`` stands for it); it is the reference the document
    masks are checked against."""
    s = tokens.shape[1]
    arange = torch.arange(s, device=tokens.device)
    starts = torch.zeros_like(tokens)
    starts[:, 1:] = torch.where(tokens[:, :-1] == eod, arange[1:], 0)  # a document starts after each EOD
    doc_start = torch.cummax(starts, dim=1).values  # [b, s]: where each query's document starts
    causal = arange[None, :] > arange[:, None]  # [s, s]: key after query
    other_doc = arange[None, None, :] < doc_start[:, :, None]  # [b, s, s]: key before the query's document
    return (causal | other_doc).unsqueeze(1)


def batch_keys(pre_process: bool, post_process: bool) -> tuple[str, ...]:
    """The batch entries a stage with these roles needs (none for a middle stage)."""
    return (FIRST_STAGE_KEYS if pre_process else ()) + (LAST_STAGE_KEYS if post_process else ())


def _broadcast(
    batch: dict | None,
    keys: tuple[str, ...],
    seq_length: int,
    micro_batch_size: int,
    pg,
    device: torch.device,
) -> dict:
    """tp rank 0's tensors to the other tp ranks (shapes known in advance: no metadata exchange)."""
    specs = {key: ((micro_batch_size, seq_length), DTYPES[key]) for key in keys}
    return broadcast_batch(
        list(keys), batch, specs, pg.tp_group, src_rank=pg.group_ranks["tp"][0], device=device
    )


def get_batch(
    data_iterator,
    device: torch.device,
    pg=None,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    keys: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids"),
) -> dict:
    """Next micro-batch's ``keys`` on ``device`` (an empty dict when ``keys`` is empty: a middle
    pipeline stage reads nothing). With tensor parallelism only tp rank 0 reads data; the other tp
    ranks receive the same tensors."""
    if not keys:
        return {}
    batch = None
    if data_iterator is not None and (pg is None or pg.tp_rank == 0):
        batch = {
            k: v.to(device, non_blocking=True)
            for k, v in next(data_iterator).items()
            if isinstance(v, torch.Tensor) and k in keys
        }
    if pg is None or pg.tp_size == 1:
        return batch
    return _broadcast(batch, keys, seq_length, micro_batch_size, pg, device)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, token count, {'lm loss': [sum, count]}) as Megatron reports it."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach()])}


def slice_batch_for_cp(batch: dict, pg) -> dict:
    """This cp rank's two chunks (``context_parallel.layout``) of every batch entry, all of which run
    along dim 1: position ids keep their global values, so RoPE rotates by global positions."""
    if pg is None or pg.cp_size == 1:
        return batch
    return {k: slice_for_cp(v, 1, pg.cp_size, pg.cp_rank) for k, v in batch.items()}


def forward_step(
    data_iterator,
    model,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    attention_mask: str = CAUSAL,
    eod: int | None = None,
):
    """Megatron's ``forward_step``: (per-token losses [b, s/cp] on the last stage, else the activation
    [s/cp, b, h] for the next stage; loss_func). ``attention_mask`` is an ``attention_mask_source``;
    ``eod`` (the tokenizer's end-of-document id) is needed with ``DOCUMENTS``.

    Every cp rank reads the whole micro-batch (cp ranks are not data-parallel) and keeps its chunks;
    a document mask is built from the full sequence first, so each rank masks by global positions."""
    module = model
    while hasattr(module, "module"):
        module = module.module
    device = next(module.parameters()).device
    keys = batch_keys(module.pre_process, module.post_process)
    batch = get_batch(data_iterator, device, module.pg, seq_length, micro_batch_size, keys)
    mask = None
    if attention_mask == DOCUMENTS and "tokens" in batch:  # --reset-attention-mask runs with pp 1 only
        assert eod is not None, "forward_step builds the document mask from the tokens: give eod"
        mask = DocumentMask.from_tokens(batch["tokens"], eod)
    batch = slice_batch_for_cp(batch, module.pg)
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        mask,
        labels=batch.get("labels"),
        loss_mask=batch.get("loss_mask"),
    )
    return output, partial(loss_func, batch.get("loss_mask"))


def _samples(trainer) -> list[int]:
    lg, gbs = trainer.cfg.logger, trainer.global_batch_size
    train = trainer.train_iters * gbs
    evals = (trainer.train_iters // lg.eval_interval + 1) if lg.eval_interval else 1
    return [train, evals * lg.eval_iters * gbs, lg.eval_iters * gbs]


def data_iterators(trainer):
    """Train / valid / test iterators positioned at the consumed samples of the loaded checkpoint.

    Each split is a list with one entry per model chunk: an iterator where the chunk reads data (the
    first and last pipeline stage, tp rank 0), None elsewhere.
    """
    cfg, pg = trainer.cfg, trainer.pg
    datasets = build_train_valid_test_datasets(
        cfg.data,
        trainer.tokenizer,
        cfg.training.seq_length,
        cfg.training.seed,
        _samples(trainer),
        parallel_state=pg,
        log=print_rank_0,
        padded_vocab_size=trainer.padded_vocab_size,
    )
    consumed = [trainer.state.consumed_train_samples, trainer.state.consumed_valid_samples, 0]
    chunks = [c.module if hasattr(c, "module") else c for c in trainer.model]
    reads = [bool(batch_keys(c.pre_process, c.post_process)) and pg.tp_rank == 0 for c in chunks]
    iterators = []
    has_split = torch.tensor([ds is not None for ds in datasets], dtype=torch.int32, device=trainer.device)
    torch.distributed.broadcast(has_split, src=0)  # ranks without data follow global rank 0
    for ds, done in zip(datasets, consumed):
        loader = None
        if any(reads):
            loader = build_pretraining_data_loader(
                ds,
                done,
                cfg.training.micro_batch_size,
                pg.dp_rank,
                pg.dp_size,
                cfg.data.num_workers,
                dataloader_type=cfg.data.dataloader_type,
                seed=cfg.training.seed,
            )
        it = iter(loader) if loader is not None else None
        iterators.append([it if r else None for r in reads])
    return tuple(iterators), [bool(x) for x in has_split.tolist()]


class GPTProviders:
    """What ``megatron.training.pretrain`` needs to train a GPT."""

    tokenizer = staticmethod(tokenizer_provider)
    model = staticmethod(model_provider)

    def __init__(self, cfg):
        self.mask_source = attention_mask_source(cfg.data)
        self.forward_step = partial(
            forward_step,
            seq_length=cfg.training.seq_length,
            micro_batch_size=cfg.training.micro_batch_size,
            attention_mask=self.mask_source,
        )

    def data_iterators(self, trainer):
        """``data_iterators(trainer)``; it also hands ``forward_step`` the tokenizer's end-of-document
        id, where document masks are built."""
        if self.mask_source == DOCUMENTS:
            self.forward_step = partial(self.forward_step, eod=trainer.tokenizer.eod)
        return data_iterators(trainer)
