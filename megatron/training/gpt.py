"""The GPT-specific pieces of ``pretrain``: tokenizer, model, batches, loss and data iterators."""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.datasets.provider import build_train_valid_test_datasets
from megatron.training.loop_utils import print_rank_0


def tokenizer_provider(cfg, pg):
    """The tokenizer and the padded vocabulary size (a multiple of divisible-by x tp)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    padded = cfg.tokenizer.padded_vocab_size or vocab_size_with_padding(
        tokenizer.vocab_size, cfg.training.make_vocab_size_divisible_by, pg.tp_size, log=print_rank_0)
    return tokenizer, padded


def model_provider(cfg, padded_vocab_size: int, pg, device) -> GPTModel:
    return GPTModel(
        config=cfg.model, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded_vocab_size,
        max_sequence_length=cfg.training.max_position_embeddings, parallel_state=pg, device=device,
        seed=cfg.training.seed, sequence_parallel=cfg.model.sequence_parallel,
    )


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator, device: torch.device, pg=None, seq_length: int | None = None,
              micro_batch_size: int | None = None) -> dict:
    """Next micro-batch on ``device``. With tensor parallelism only tp rank 0 reads data; the other
    tp ranks receive the same tensors (shapes are known in advance, so no metadata is exchanged)."""
    batch = None
    if data_iterator is not None:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()
                 if isinstance(v, torch.Tensor)}
    if pg is None or pg.tp_size == 1:
        return batch
    from megatron.core.tensor_parallel.data import broadcast_data

    shapes = {k: (micro_batch_size, seq_length) for k in BATCH_KEYS}
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64}
    return broadcast_data(list(BATCH_KEYS), batch, shapes, dtypes, pg.tp_group, src_rank=pg.group_ranks["tp"][0])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, token count, {'lm loss': [sum, count]}) as Megatron reports it."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach()])}


def forward_step(data_iterator, model, seq_length: int | None = None, micro_batch_size: int | None = None):
    """Megatron's ``forward_step``: (per-token losses [b, s], loss_func)."""
    module = model.module if hasattr(model, "module") else model
    device = next(module.parameters()).device
    batch = get_batch(data_iterator, device, module.pg, seq_length, micro_batch_size)
    output = model(batch["tokens"], batch.get("position_ids"), batch.get("attention_mask"),
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _samples(trainer) -> list[int]:
    lg, gbs = trainer.cfg.logger, trainer.global_batch_size
    train = trainer.train_iters * gbs
    evals = (trainer.train_iters // lg.eval_interval + 1) if lg.eval_interval else 1
    return [train, evals * lg.eval_iters * gbs, lg.eval_iters * gbs]


def data_iterators(trainer):
    """Train / valid / test iterators positioned at the consumed samples of the loaded checkpoint."""
    cfg, pg = trainer.cfg, trainer.pg
    datasets = build_train_valid_test_datasets(
        cfg.data, trainer.tokenizer, cfg.training.seq_length, cfg.training.seed, _samples(trainer),
        parallel_state=pg, log=print_rank_0,
    )
    consumed = [trainer.state.consumed_train_samples, trainer.state.consumed_valid_samples, 0]
    iterators = []
    has_split = torch.tensor([ds is not None for ds in datasets], dtype=torch.int32, device=trainer.device)
    torch.distributed.broadcast(has_split, src=0)  # ranks without data follow global rank 0
    for ds, done in zip(datasets, consumed):
        loader = build_pretraining_data_loader(
            ds, done, cfg.training.micro_batch_size, pg.dp_rank, pg.dp_size, cfg.data.num_workers,
            dataloader_type=cfg.data.dataloader_type, seed=cfg.training.seed,
        )
        iterators.append(iter(loader) if loader is not None else None)
    return tuple(iterators), [bool(x) for x in has_split.tolist()]


class GPTProviders:
    """What ``megatron.training.pretrain`` needs to train a GPT."""

    tokenizer = staticmethod(tokenizer_provider)
    model = staticmethod(model_provider)
    data_iterators = staticmethod(data_iterators)

    def __init__(self, cfg):
        self.forward_step = partial(forward_step, seq_length=cfg.training.seq_length,
                                    micro_batch_size=cfg.training.micro_batch_size)
