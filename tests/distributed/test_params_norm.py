"""--log-params-norm: the parameter norm is the same under every layout (tensor-parallel shards and
pipeline stages summed, replicated and tied copies counted once)."""

from __future__ import annotations

import math

import pytest
import torch
from harness import device, distributed_test

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.loop_utils import params_l2_norm


def _model(ps: ParallelState, **stage) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        share_embeddings_and_output_weights=True,
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        parallel_state=ps,
        device=device(),
        seed=3,
        **stage,
    )


def _reference() -> float:
    model = _model(ParallelState(grid=RankGrid(), rank=0))
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
@distributed_test(world_size=2, tp="tp", pp="pp")
def test_params_norm_is_the_same_under_tensor_and_pipeline_parallelism(
    ps: ParallelState, tp: int, pp: int
) -> None:
    stage = dict(
        pre_process=ps.pp_rank == 0,
        post_process=ps.pp_rank == ps.pp_size - 1,
        num_layers=1 if pp == 2 else None,
        layer_offset=ps.pp_rank if pp == 2 else 0,
    )
    if pp == 1:
        stage = {}
    norm = params_l2_norm([_model(ps, **stage)], ps, device())
    assert norm == pytest.approx(_reference(), rel=1e-6)
    assert torch.isfinite(torch.tensor(norm))
