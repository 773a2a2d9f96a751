"""The MoE layer's compiled kernels on a GPU (bf16): the layer with ``compile_helpers`` gives the
eager layer's outputs and gradients, the grouped GEMM runs, and a GPT model with MoE layers compiles
its layers (the MoE layer outside their graphs) and trains:

    python -m pytest tests/gpu/test_moe_kernels.py -q
"""

import dataclasses

import pytest
import torch

from megatron.core.execution_plan import resolve
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.execution_setup import compile_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def moe_config(**kw):
    base = dict(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=512,
        activation="swiglu",
        normalization="RMSNorm",
        add_bias_linear=False,
        num_moe_experts=8,
        moe_ffn_hidden_size=256,
        moe_router_topk=2,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_grouped_gemm=True,
        params_dtype=torch.bfloat16,
    )
    base.update(kw)
    return TransformerConfig(**base)


def run_layer(compiled: bool, cfg: TransformerConfig, dtype=torch.bfloat16):
    """Outputs and gradients of one MoE layer (parameters drawn in fp32, then cast to ``dtype``)."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(cfg, params_dtype=dtype)
    layer = MoELayer(cfg, compile_helpers=compiled).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.05)
    gen.manual_seed(1)
    x = torch.randn(64, 4, 256, device="cuda", generator=gen).to(dtype).requires_grad_()
    out, _ = layer(x)
    out.float().square().mean().backward()
    return out.detach().float(), x.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}


def error(a, ref):
    return float((a - ref).norm() / ref.norm())


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_compiled_kernels_match_the_eager_layer(score):
    """Against the fp32 layer, the compiled bf16 layer errs no more than the eager bf16 layer (its
    SwiGLU rounds once, the eager one twice: they differ by bf16 ulps, not by a wrong result)."""
    cfg = moe_config(moe_router_score_function=score, moe_router_enable_expert_bias=score == "sigmoid")
    ref = run_layer(False, cfg, torch.float32)
    eager, compiled = run_layer(False, cfg), run_layer(True, cfg)
    for i, name in ((0, "output"), (1, "input gradient")):
        assert error(compiled[i], ref[i]) <= 1.2 * error(eager[i], ref[i]) + 1e-4, name
        assert error(compiled[i], ref[i]) < 2e-2, name
    for n in ref[2]:
        assert error(compiled[2][n], ref[2][n]) <= 1.2 * error(eager[2][n], ref[2][n]) + 1e-4, n
        assert error(compiled[2][n], ref[2][n]) < 5e-2, n


def test_a_moe_gpt_model_compiles_its_layers_and_trains():
    cfg = moe_config(num_layers=2)
    plan = resolve(cfg, torch.device("cuda"))
    assert plan.compile_layers and plan.compile_helpers, plan.compile_reason
    torch.manual_seed(0)
    model = GPTModel(
        cfg, get_gpt_decoder_block_plan_spec(plan), vocab_size=512, max_sequence_length=128
    ).cuda()
    assert compile_model(plan, [model]) == 2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(
        0, 512, (4, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
    )
    losses = []
    for _ in range(8):
        loss = model(ids, None, None, labels=ids).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_the_router_gemm_gives_the_fp32_logits_without_an_fp32_copy():
    cfg = moe_config()
    layer = MoELayer(cfg).cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    logits = layer.router.gating(x)
    assert logits.dtype == torch.float32
    expected = x.float() @ layer.router.weight.float().t()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
