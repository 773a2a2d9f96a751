"""Activation recompute (full uniform / full block / selective) changes memory, never the numbers:
losses and gradients are bitwise identical to no recompute, dropout included."""

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VARIANTS = [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
]


def _loss_and_grads(**kw):
    pg = ParallelState(grid=RankGrid(), rank=0)
    pg.rng_tracker = model_parallel_seed(5, 0)
    cfg = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1, **kw
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, seed=3, parallel_state=pg
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    loss = model(ids, None, None, labels=ids).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", VARIANTS, ids=["full-uniform", "full-block", "selective"])
def test_recompute_is_bitwise_identical(variant):
    ref_loss, ref_grads = _loss_and_grads()
    loss, grads = _loss_and_grads(**variant)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_recompute_flags_are_checked():
    with pytest.raises(ValueError, match="recompute_method uniform"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity="full")
    with pytest.raises(ValueError, match="recompute_granularity full"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_method="block")
