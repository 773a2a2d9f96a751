"""The trainer's MoE step pieces: the auxiliary losses' gradient scale the schedule sets for each
micro-batch, the expert-bias update after the step, the metrics read at a log line, and Megatron-LM's
``args.num_experts``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from megatron.core.pipeline_parallel.schedule_steps import forward_step, set_aux_loss_scale
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.megatron_args import parse_args
from megatron.training.moe_metrics import MoEStepHooks, format_moe_metrics, tracked_losses


def _scale() -> float:
    return float(moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale)


def _cfg(per_token=False, grad_scale_func=None):
    return SimpleNamespace(
        calculate_per_token_loss=per_token, grad_scale_func=grad_scale_func, num_moe_experts=4
    )


def test_aux_loss_scale_follows_the_main_loss():
    cpu = torch.device("cpu")
    set_aux_loss_scale(_cfg(), 4, SimpleNamespace(), cpu)
    assert _scale() == 0.25  # 1 / micro-batches
    set_aux_loss_scale(_cfg(), 4, SimpleNamespace(pg=SimpleNamespace(cp_size=2)), cpu)
    assert _scale() == 0.5  # x cp: the cp ranks' shares are averaged over dp x cp with the gradients
    set_aux_loss_scale(_cfg(per_token=True), 4, SimpleNamespace(pg=SimpleNamespace(cp_size=2)), cpu)
    assert _scale() == 1.0  # per-token loss: Megatron-Core's 1
    set_aux_loss_scale(_cfg(grad_scale_func=lambda t: t * 1024.0), 8, SimpleNamespace(), cpu)
    assert _scale() == 128.0  # x the fp16 loss scale


def test_forward_step_sets_the_scale_on_every_stage():
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(0.0)
    model = torch.nn.Linear(2, 2)
    forward_step(
        lambda it, m: (torch.ones(1), None), None, model, 5, _cfg(), False, [], [], is_last_stage=False
    )
    assert _scale() == pytest.approx(0.2)


def _layer(**kw) -> MoELayer:
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=4, moe_router_topk=1, **kw
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg, layer_number=1)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def test_expert_bias_moves_after_the_step_and_metrics_are_read_once():
    layer = _layer(
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    )
    hooks = MoEStepHooks(layer.config, SimpleNamespace(pp_group=None, dp_group=None))
    assert hooks.names == ["load_balancing_loss", "z_loss"]
    moe_utils.clear_aux_losses_tracker()
    out, _ = layer(torch.randn(8, 2, 16))
    out.sum().backward()
    counts = layer.router.local_tokens_per_expert.clone()
    assert counts.sum() == 16  # 16 tokens, top-1
    hooks.after_step([layer], num_microbatches=1)
    expected = torch.sign(counts.mean() - counts) * 1e-3
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.router.local_tokens_per_expert.sum() == 0
    metrics = hooks.read()
    assert metrics["load_balancing_loss"] > 0 and metrics["z_loss"] > 0
    assert metrics["expert_load_imbalance"] == pytest.approx(float(counts.max() / counts.mean()))
    line = " | ".join(format_moe_metrics(metrics))
    assert (
        line.startswith("load_balancing_loss: ") and "z_loss: " in line and "expert load max/mean: " in line
    )
    assert hooks.read()["load_balancing_loss"] == 0.0  # the tracker was cleared by the first read


def test_tracked_losses_follow_the_balancing_types():
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 0.0],
    )
    assert tracked_losses(cfg) == ["load_balancing_loss"]  # a zero coefficient records nothing


def test_megatron_args_carry_num_experts(monkeypatch):
    flags = (
        "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3 --mock-data --vocab-size 64 --num-experts 4 --moe-router-topk 1"
    )
    monkeypatch.setattr(sys, "argv", ["train.py", *flags.split()])
    args = parse_args()
    assert args.num_experts == 4 and args.moe_router_topk == 1 and args.expert_model_parallel_size == 1
