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
        seed=cfg.training.seed,
    )


def get_batch(data_iterator, device: torch.device) -> dict:
    batch = next(data_iterator)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, token count, {'lm loss': [sum, count]}) as Megatron reports it."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach()])}


def forward_step(data_iterator, model):
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, device)
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
    for ds, done in zip(datasets, consumed):
        loader = build_pretraining_data_loader(
            ds, done, cfg.training.micro_batch_size, pg.dp_rank, pg.dp_size, cfg.data.num_workers,
            dataloader_type=cfg.data.dataloader_type, seed=cfg.training.seed,
        )
        iterators.append(iter(loader) if loader is not None else None)
    return tuple(iterators)


class GPTProviders:
    """What ``megatron.training.pretrain`` needs to train a GPT."""

    tokenizer = staticmethod(tokenizer_provider)
    model = staticmethod(model_provider)
    forward_step = staticmethod(forward_step)
    data_iterators = staticmethod(data_iterators)
