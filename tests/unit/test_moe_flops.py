"""Model FLOPs, the execution plan, the memory estimate and the dry run of MoE models.

FLOPs against a hand-computed value of Megatron's formula (routed experts: k active experts of
F_moe; shared experts F_sh; dense layers F; the --moe-layer-freq pattern); the memory estimate holds
the E / ep local experts of a rank split over etp, and the distributed optimizer shards them over
expert-dp."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn.functional as F

from megatron.core.execution_plan import ExecutionPlan
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_plan_spec,
    get_gpt_decoder_block_spec,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_run_config
from megatron.training.dry_run import dry_run
from megatron.training.flops import num_floating_point_operations, shape_from_config
from megatron.training.memory_estimate import estimate
from megatron.training.memory_params import stage_params

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 --swiglu "
    "--ffn-hidden-size 256 --disable-bias-linear"
).split()
MOE = "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 64".split()


@pytest.fixture
def world(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))

    set_world(1)
    return set_world


def test_moe_flops_by_hand():
    """L = 4 with pattern [0, 1, 1, 1]: one dense layer (F 256), three MoE layers (k = 2 of F_moe 32,
    shared F_sh 64); h 64, 4 heads of 16 (MHA), SwiGLU (e = 3), V 128, B 2, s 16."""
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        gated_linear_unit=True,
        activation_func=F.silu,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq=[0, 1, 1, 1],
    )
    mlp = 6 * 64 * (3 * 256 * 1 + 3 * 32 * 2 * 3 + 3 * 64 * 3)  # dense + routed + shared = 737280
    proj = 6 * (64 * (64 + 2 * 16 * 4) + 64 * 64) * 4  # 393216
    logits = 6 * 64 * 128  # 49152
    core = 2 * 16 * 16 * 6 * 64 * 4  # B s^2 6 q_p L = 786432
    expected = 2 * 16 * (mlp + proj + logits) + core
    assert expected == 38535168
    assert num_floating_point_operations(shape_from_config(cfg, 128), 2, 16) == expected
    # The same model with every layer MoE (freq 1) and without experts, for contrast.
    every = dataclasses.replace(cfg, moe_layer_freq=1)
    mlp_every = 6 * 64 * (3 * 32 * 2 * 4 + 3 * 64 * 4)
    assert (
        num_floating_point_operations(shape_from_config(every, 128), 2, 16)
        == 32 * (mlp_every + proj + logits) + core
    )
    dense = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
    assert shape_from_config(dense, 128).num_moe_layers == 0


def test_int_layer_freq_marks_every_nth_layer_from_the_first():
    cfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_layer_freq=2
    )
    shape = shape_from_config(cfg, 128)
    assert shape.num_moe_layers == 2  # layers 0 and 2
    plan = ExecutionPlan.plain(cfg)
    assert plan.moe_layers == {1, 3}
    specs = get_gpt_decoder_block_plan_spec(plan).layer_specs
    moe = [getattr(s.submodules.mlp, "module", None) is MoELayer for s in specs]
    assert moe == [True, False, True, False]
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    assert [getattr(s.submodules.mlp, "module", None) is MoELayer for s in block.layer_specs] == moe


def _expert_elements(params) -> int:
    return sum(i.numel for row in params.chunks for c in row for i in c.params if i.expert)


def test_memory_estimate_counts_the_local_experts(world):
    """ep 2 holds half of the experts' elements per rank, etp 2 half again; the dense part is unchanged."""
    world(4)
    one = parse_run_config(BASE + MOE)
    ep2 = parse_run_config(BASE + MOE + ["--expert-model-parallel-size", "2"])
    etp2 = parse_run_config(
        BASE + MOE + "--expert-model-parallel-size 2 --expert-tensor-parallel-size 2".split()
    )
    p1, p2, p4 = (stage_params(c, 128) for c in (one, ep2, etp2))
    # every layer is MoE (freq 1): 4 layers x 8 experts x (fc1 [2 x 32, 64] + fc2 [64, 32])
    assert _expert_elements(p1) == 4 * 8 * (2 * 32 * 64 + 64 * 32)
    assert _expert_elements(p2) * 2 == _expert_elements(p1)
    assert _expert_elements(p4) * 4 == _expert_elements(p1)
    dense = lambda p: sum(i.numel for row in p.chunks for c in row for i in c.params if not i.expert)  # noqa: E731
    assert dense(p1) == dense(p2) == dense(p4)
    w1, w2 = (estimate(c, 128, 4, params=p)[0] for c, p in ((one, p1), (ep2, p2)))
    assert w1.weights - w2.weights == pytest.approx(_expert_elements(p2) * 4)  # fp32 weights
    # The distributed optimizer shards experts over expert-dp (4 / ep 2 = 2), dense params over dp 4.
    dist = parse_run_config(BASE + MOE + "--expert-model-parallel-size 2 --use-distributed-optimizer".split())
    pd = stage_params(dist, 128)
    expert_state = _expert_elements(pd) * 8 / 2  # Adam moments of fp32 params, over expert-dp 2
    dense_state = dense(pd) * 8 / 4
    assert estimate(dist, 128, 4, params=pd)[0].optimizer == pytest.approx(
        expert_state + dense_state, rel=0.05
    )


def test_moe_activations_count_the_routed_rows(world):
    """Top-k 4 routes 2 more rows per token than top-k 2 through the experts of each of the 4 MoE
    layers; each routed row saves (fp32, CUDA kernels: the SwiGLU kernel keeps only fc1's output) its
    input h, fc1's output 2 F_moe, the activation's output F_moe and fc2's output h."""
    k2 = parse_run_config(BASE + MOE)
    k4 = parse_run_config(BASE + [*MOE[:2], "--moe-router-topk", "4", *MOE[4:]])
    a2, a4 = (estimate(c, 128, 1)[0].activations_per_microbatch for c in (k2, k4))
    rows, h, f = 2 * 16 * 2, 64, 32  # micro-batch tokens x 2
    assert a4 - a2 == 4 * rows * 4 * (h + 2 * f + f + h)


def test_recomputed_moe_layers_keep_only_their_input(world):
    """--recompute-granularity selective --recompute-modules moe: each of the 4 MoE layers saves its
    normed input (tokens x h, fp32) instead of its routed rows; core_attn beside it changes the
    attention's share only (the same with and without experts recomputed)."""
    plain = parse_run_config(BASE + MOE)
    sel = "--recompute-granularity selective --recompute-modules".split()
    moe = parse_run_config(BASE + MOE + sel + ["moe"])
    both = parse_run_config(BASE + MOE + sel + ["core_attn", "moe"])
    attn = parse_run_config(BASE + MOE + sel + ["core_attn"])
    a_plain, a_moe, a_both, a_attn = (
        estimate(c, 128, 1)[0].activations_per_microbatch for c in (plain, moe, both, attn)
    )
    t, h, f, e, k, sh = 2 * 16, 64, 32, 8, 2, 64  # tokens, hidden, F_moe, experts, top-k, F_sh
    # no longer saved per MoE layer: the router's fp32 logits, scores and weights [T, E], the
    # routed rows' input h, fc1's output 2F, the activation's output F and fc2's output h, and the
    # shared experts' fc1 output 2 F_sh and fc2 input F_sh on every token
    layer = 3 * t * e * 4 + t * k * (h + 2 * f + f + h) * 4 + t * (2 * sh + sh) * 4
    assert a_plain - a_moe == pytest.approx(4 * layer)
    assert a_attn - a_both == pytest.approx(4 * layer)
    assert a_moe > a_both  # core attention kept without core_attn


def test_dry_run_prints_the_expert_layout(world, capsys):
    world(8)
    cfg = parse_run_config(
        BASE + MOE + "--expert-model-parallel-size 4 --moe-layer-freq [0]*1+[1]*3 --dry-run".split()
    )
    lines = []
    dry_run(cfg, 128, log=lines.append)
    text = "\n".join(lines)
    assert (
        "experts: 8 of FFN 32 (top-2, shared experts of 64) in layers 2, 3, 4; expert grid etp 1 x ep 4 x "
        "expert-dp 2 x pp 1: 2 local experts per rank" in text
    )
