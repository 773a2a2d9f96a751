"""The execution plan on a GPU: the Triton self-checks really run at resolve, the model dispatches
to the kernels that passed, and a kernel forced to fail its self-check is neither reported as used
nor dispatched to (the model then runs the torch code, and trains):

    python -m pytest tests/gpu -q
"""

import pytest
import torch

from megatron.core.execution_plan import resolve
from megatron.core.fusions.fp8 import Fp8Gemm
from megatron.core.fusions.swiglu import swiglu_torch, swiglu_triton
from megatron.core.fusions.triton import KERNELS, self_check, triton
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.mlp import Fp8SwigluMLP
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs a CUDA device and Triton"
)


def llama(**kw):
    base = dict(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        activation="swiglu",
        ffn_hidden_size=256,
        position_embedding_type="rope",
        add_bias_linear=False,
        cross_entropy_loss_fusion=True,
        bf16=True,
        fp8_amax_history_len=16,
    )
    base.update(kw)
    return TransformerConfig(**base)


def build(plan):
    return GPTModel(
        plan.config,
        get_gpt_decoder_block_plan_spec(plan),
        vocab_size=256,
        max_sequence_length=64,
        seed=1,
        device="cuda",
        execution_plan=plan,
    )


def step(model):
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    loss = model(ids, None, None, labels=ids).float().mean()
    loss.backward()
    return loss


def test_every_kernel_passes_its_self_check_and_the_model_uses_them():
    plan = resolve(llama(), torch.device("cuda"), torch_compile=False)
    assert dict(plan.triton_checks) == dict.fromkeys(KERNELS), plan.triton_checks
    model = build(plan)
    assert {layer.mlp.activation for layer in model.decoder.layers} == {swiglu_triton}
    assert model.output_loss.use_triton and plan.cross_entropy == "fused_triton"
    text = "\n".join(plan.report_lines())
    assert "SwiGLU backward: Triton kernel" in text and "one Triton kernel per chunk" in text
    assert torch.isfinite(step(model))


@pytest.mark.parametrize("failing", KERNELS)
def test_a_kernel_forced_to_fail_its_self_check_is_not_dispatched(monkeypatch, failing):
    """The self-check itself is patched to fail: resolve, the report and the built model agree."""
    import megatron.core.fusions.triton as kernels

    checks = dict(kernels.SELF_CHECKS)
    checks[failing] = lambda device: "forced by the test"
    monkeypatch.setattr(kernels, "SELF_CHECKS", checks)
    cfg = llama(fp8_format="hybrid", fp8_recipe="delayed") if "fp8" in failing else llama()
    plan = resolve(cfg, torch.device("cuda"), torch_compile=False, self_check_fn=kernels.self_check)
    assert plan.triton_reason(failing) == "disagrees with the torch code: forced by the test"
    assert f"{failing} (disagrees with the torch code: forced by the test)" in "\n".join(plan.report_lines())
    model = build(plan)
    if failing == "swiglu":
        assert {layer.mlp.activation for layer in model.decoder.layers} == {swiglu_torch}
    if failing == "cross_entropy":
        assert not model.output_loss.use_triton
    gemms = [m for m in model.modules() if isinstance(m, Fp8Gemm)]
    if failing == "fp8_cast":
        assert gemms and not any(g.use_triton for g in gemms)
    if failing == "swiglu_fp8":
        assert all(
            not layer.mlp.fp8_swiglu.use_triton
            for layer in model.decoder.layers
            if isinstance(layer.mlp, Fp8SwigluMLP)
        )
    for _ in range(3):  # FP8's block path starts once the histories are warm
        assert torch.isfinite(step(model))
        model.zero_grad()


def test_self_check_runs_each_time_it_is_asked():
    assert self_check(torch.device("cuda")) == dict.fromkeys(KERNELS)
    assert self_check(torch.device("cpu"))["swiglu"].startswith("not a CUDA device")
