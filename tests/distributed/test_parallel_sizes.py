"""A TransformerConfig that leaves the parallel sizes at 1 (Megatron-Core's walkthrough) is split by
the process groups: GPTModel built under ``initialize_model_parallel(tp=2)`` holds half of every
split weight and computes the one-process model's loss; under pp 2 each stage builds its layers; the
schedules' activation shape follows the groups they are given."""

from __future__ import annotations

import pytest
import torch
from harness import device, distributed_test

from megatron.core.config_utils import ConfigError
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.pipeline_parallel.schedules import tensor_shape
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, VOCAB = 16, 2, 100


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=12,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **{"share_embeddings_and_output_weights": True, **kw},
    )


def _build(cfg: TransformerConfig, **kw) -> GPTModel:
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=S,
        seed=9,
        device=device(),
        **kw,
    )


@distributed_test(world_size=2, tp=2)
def test_default_config_is_split_by_the_tp_groups(ps: ParallelState) -> None:
    model = _build(_config())  # no parallel_state: the default one initialize_model_parallel recorded
    assert model.pg is ps
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape == (3 * 12 // 2, 12)
    assert model.decoder.layers[0].mlp.linear_fc2.weight.shape == (12, 48 // 2)
    assert model.embedding.word_embeddings.weight.shape == (VOCAB // 2, 12)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0)).to(device())
    loss = model(ids, None, None, labels=ids.roll(-1, 1))
    one_rank = ParallelState(grid=RankGrid(), rank=0)
    ref = _build(_config(), parallel_state=one_rank)(ids, None, None, labels=ids.roll(-1, 1))
    torch.testing.assert_close(loss, ref)

    with pytest.raises(
        ConfigError,
        match=r"TransformerConfig.tensor_model_parallel_size is 4 but the "
        "model is built on process groups of size 2",
    ) as error:
        _build(_config(tensor_model_parallel_size=4))
    assert error.value.params == ("tensor_model_parallel_size",)  # the application names the flag
    assert _build(_config(tensor_model_parallel_size=2)).pg.tp_size == 2  # an explicit, matching size


@distributed_test(world_size=2, tp=2)
def test_activation_shape_follows_the_model_groups(ps: ParallelState) -> None:
    cfg = _config(sequence_parallel=True)  # tp left at 1: the groups' 2 splits the sequence
    model = _build(cfg)
    assert model.sequence_parallel
    assert tensor_shape(model, cfg, S, B, ps.tp_size) == (S // 2, B, 12)
    assert tensor_shape(_build(_config()), cfg, S, B, ps.tp_size) == (S, B, 12)


@distributed_test(world_size=2, pp=2)
def test_default_config_builds_this_stages_layers(ps: ParallelState) -> None:
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = _build(_config(), pre_process=first, post_process=last)
    assert len(model.decoder.layers) == 1 and model.decoder.layer_offset == ps.pp_rank
    names = {n for n, _ in model.named_parameters()}
    assert ("decoder.final_layernorm.weight" in names) == last
    with pytest.raises(ValueError, match="vp_stage 1 is not a virtual pipeline stage"):
        _build(_config(), vp_stage=1)
