"""The execution plan: resolved once from config, device and the Triton self-checks; the layers are
built from it, and the start-up report prints it (the two never disagree)."""

import pytest
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.execution_plan import ExecutionPlan, resolve
from megatron.core.fusions.fp8 import Fp8Gemm
from megatron.core.fusions.swiglu import swiglu_torch, swiglu_triton
from megatron.core.fusions.triton import KERNELS
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.output_loss import FusedLinearCrossEntropy, LogitsCrossEntropy
from megatron.core.transformer.mlp import MLP, Fp8SwigluMLP
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.filterwarnings("ignore:FP8 emulated on the CPU")
ALL_PASS = dict.fromkeys(KERNELS)


def llama(**kw):
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        activation="swiglu",
        ffn_hidden_size=128,
        position_embedding_type="rope",
        add_bias_linear=False,
        cross_entropy_loss_fusion=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


def fp8(**kw):
    return llama(
        **{**dict(bf16=True, fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=16), **kw}
    )


def build(plan, seed=3):
    return GPTModel(
        plan.config,
        get_gpt_decoder_block_plan_spec(plan),
        vocab_size=64,
        max_sequence_length=16,
        seed=seed,
        execution_plan=plan,
    )


def report(plan, **kw):
    return "\n".join(plan.report_lines(**kw))


def test_cpu_plan_is_the_torch_code_and_says_why():
    calls = []

    def check(device, interpret):
        calls.append((device.type, interpret))
        return dict.fromkeys(KERNELS, "not a CUDA device (cpu)")

    plan = resolve(llama(), "cpu", self_check_fn=check)
    assert calls == [("cpu", False)]  # the self-check runs once, at resolve
    assert (plan.swiglu, plan.cross_entropy, plan.compile_layers, plan.fp8) == (
        "torch",
        "fused_eager",
        False,
        None,
    )
    assert plan.kernels.enabled == frozenset()
    text = report(plan)
    assert "not compiled: CPU run" in text and "fused output layer" in text and "FP8: off" in text
    assert "Triton: not used: swiglu, cross_entropy, fp8_cast, swiglu_fp8 (not a CUDA device (cpu))" in text
    assert (
        resolve(llama(cross_entropy_loss_fusion=False), "cpu", triton_checks=ALL_PASS).cross_entropy
        == "unfused"
    )
    assert resolve(llama(), "cpu", 2, triton_checks=ALL_PASS).cross_entropy == "vocab_parallel"


@pytest.mark.parametrize("failing", ["swiglu", "cross_entropy"])
def test_a_kernel_that_fails_its_self_check_is_reported_and_not_dispatched(failing):
    """The issue's check: the report and the kernel the model dispatches to agree, for a forced failure."""
    checks = {**ALL_PASS, failing: "disagrees with the torch code: forced by the test"}
    plan = resolve(llama(), torch.device("cuda"), triton_checks=checks)  # a CUDA plan, built here on the CPU
    model = build(plan)
    activations = {layer.mlp.activation for layer in model.decoder.layers}
    text = report(plan)
    assert f"not used: {failing} (disagrees with the torch code: forced by the test)" in text
    if failing == "swiglu":
        assert plan.swiglu == "torch" and activations == {swiglu_torch}
        assert "SwiGLU backward: Inductor/ATen (Triton kernel swiglu: disagrees" in text
        assert model.output_loss.use_triton and "one Triton kernel per chunk" in text
    else:
        assert (
            plan.swiglu == "triton"
            and activations == {swiglu_triton}
            and "SwiGLU backward: Triton kernel" in text
        )
        assert plan.cross_entropy == "fused_compiled" and not model.output_loss.use_triton
        assert (
            model.output_loss.compiled and "softmax/grad steps compiled (Triton kernel cross_entropy" in text
        )
    passed = [k for k in KERNELS if k != failing]
    assert f"{', '.join(passed)} passed the self-check" in text


def test_fp8_cast_failure_reaches_every_fp8_gemm_and_the_report():
    checks = {**ALL_PASS, "fp8_cast": "its self-check failed: RuntimeError: forced"}
    plan = resolve(fp8(), "cpu", triton_checks=checks, fp8_emulate=True)
    gemms = [m for m in build(plan).modules() if isinstance(m, Fp8Gemm)]
    assert len(gemms) == 8 and not any(g.use_triton for g in gemms)
    assert "quantised by torch code (Triton kernel fp8_cast: its self-check failed" in report(plan)
    ok = resolve(fp8(), "cpu", triton_checks=ALL_PASS, fp8_emulate=True)
    assert all(m.use_triton for m in build(ok).modules() if isinstance(m, Fp8Gemm))


def test_plain_plan_builds_the_local_spec_model_bit_for_bit():
    cfg = llama()
    plan = ExecutionPlan.plain(cfg)
    a, b = (
        build(plan, seed=5),
        GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, seed=5),
    )
    assert isinstance(b.output_loss, FusedLinearCrossEntropy) and not b.output_loss.use_triton
    ids = torch.randint(0, 64, (2, 16))
    for m in (a, b):
        m(ids, None, None, labels=ids).sum().backward()
    torch.testing.assert_close(a(ids, None, None), b(ids, None, None), rtol=0, atol=0)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert isinstance(
        GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
            execution_plan=resolve(cfg, "cpu", 1, triton_checks=ALL_PASS),
        ).output_loss,
        FusedLinearCrossEntropy,
    )
    with pytest.raises(ConfigError, match="resolved for tensor_model_parallel_size 2"):
        GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
            execution_plan=ExecutionPlan.plain(cfg, 2),
        )


def test_fp8_layers_linears_and_swiglu_block_come_from_the_plan():
    cfg = fp8(
        num_layers=4, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1
    )
    plan = resolve(cfg, "cpu", triton_checks=ALL_PASS, fp8_emulate=True)
    assert plan.fp8.layers == {2, 3} and plan.fp8.swiglu_block
    model = build(plan)
    for number, layer in enumerate(model.decoder.layers, start=1):
        in_fp8 = number in (2, 3)
        assert isinstance(layer.mlp, Fp8SwigluMLP) == in_fp8, number
        linears = (
            layer.self_attention.linear_qkv,
            layer.self_attention.linear_proj,
            layer.mlp.linear_fc1,
            layer.mlp.linear_fc2,
        )
        assert all((lin.fp8 is not None) == in_fp8 for lin in linears), number
    assert model.output_layer.fp8 is None
    # the checkpoint keys of the FP8 state are the linears' own (non-persistent: not in the state dict)
    assert "decoder.layers.1.mlp.linear_fc1.fp8.amax_history" in dict(model.named_buffers())
    assert not any("fp8" in k for k in model.state_dict())
    text = report(plan, fp8_linears=8)
    assert "for 8 QKV/proj/fc1/fc2 linears of 2 of the 4 transformer layers" in text
    assert "--first-last-layers-bf16" in text and "one FP8 block" in text
    for other in (dict(fp8_recipe="tensorwise"), dict(activation="gelu")):
        p = resolve(fp8(**other), "cpu", triton_checks=ALL_PASS, fp8_emulate=True)
        assert not p.fp8.swiglu_block and all(type(layer.mlp) is MLP for layer in build(p).decoder.layers)


def test_unaligned_linears_stay_in_bf16_and_the_report_names_them():
    with pytest.warns(UserWarning, match="linear_fc2 \\[64, 40\\] keep bf16 GEMMs"):
        plan = resolve(fp8(ffn_hidden_size=40), "cpu", triton_checks=ALL_PASS, fp8_emulate=True)
    assert plan.fp8.linears == ("linear_qkv", "linear_proj", "linear_fc1") and not plan.fp8.swiglu_block
    model = build(plan)
    mlp = model.decoder.layers[0].mlp
    assert type(mlp) is MLP and mlp.linear_fc1.fp8 is not None and mlp.linear_fc2.fp8 is None
    assert model.decoder.layers[0].self_attention.linear_qkv.fp8 is not None
    assert "in bf16 (a weight dim not a multiple of 16): linear_fc2 [64, 40]" in report(plan)


def test_fp8_on_a_device_without_it_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        resolve(fp8(), "cpu", triton_checks=ALL_PASS)
    assert info.value.params == ("fp8_format",)


def test_tp_plan_shards_the_shapes_and_uses_the_vocab_parallel_loss():
    plan = resolve(llama(), "cpu", 2, triton_checks=ALL_PASS)
    assert plan.cross_entropy == "vocab_parallel" and "vocab-parallel cross entropy" in report(plan)
    assert isinstance(
        build(ExecutionPlan.plain(llama(cross_entropy_loss_fusion=False))).output_loss, LogitsCrossEntropy
    )


def test_torch_compile_off_on_cuda_keeps_every_helper_eager_and_says_so():
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training.execution_setup import apply_compile_choice

    plan = resolve(llama(), torch.device("cuda"), torch_compile=False, triton_checks=ALL_PASS)
    assert (plan.compile_layers, plan.compile_helpers, plan.compile_reason) == (
        False,
        False,
        "--torch-compile off",
    )
    assert plan.cross_entropy == "fused_triton" and plan.swiglu == "triton"  # Triton needs no compile
    text = report(plan)
    assert "not compiled: --torch-compile off" in text and "eager: not compiled, --torch-compile off" in text
    cfg = SimpleNamespace(ddp=DistributedDataParallelConfig(), optimizer=OptimizerConfig())
    assert cfg.ddp.compile_helpers and cfg.optimizer.compile_helpers  # the library's defaults
    apply_compile_choice(cfg, plan)
    assert not cfg.ddp.compile_helpers and not cfg.optimizer.compile_helpers
    on = resolve(llama(), torch.device("cuda"), triton_checks=ALL_PASS)
    assert on.compile_layers and on.compile_helpers and "torch.compile of each TransformerLayer" in report(on)


def test_block_spec_gives_one_spec_per_layer_of_the_model_or_of_the_stage():
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    cfg = llama(num_layers=4)
    plain, other = get_gpt_layer_local_spec(), get_gpt_layer_local_spec(qk_layernorm=True)
    whole = TransformerBlockSubmodules(layer_specs=[plain, plain, other, other])
    stage = TransformerBlock(cfg, whole, num_layers=2, layer_offset=2)  # layers 3 and 4 of the model
    assert [layer.self_attention.q_layernorm is not None for layer in stage.layers] == [True, True]
    own = TransformerBlock(
        cfg, TransformerBlockSubmodules(layer_specs=[other, plain]), num_layers=2, layer_offset=2
    )
    assert [layer.self_attention.q_layernorm is not None for layer in own.layers] == [True, False]
    with pytest.raises(
        ConfigError, match="holds 3 specs; give one per layer of the model \\(num_layers 4\\)"
    ):
        TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=[plain] * 3), num_layers=2)


def test_activation_slot_takes_a_function_and_refuses_other_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    seen = []

    def traced(x):
        seen.append(tuple(x.shape))
        return swiglu_torch(x)

    mlp = MLP(llama(), MLPSubmodules(ColumnParallelLinear, RowParallelLinear, activation_func=traced))
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    mlp(torch.randn(3, 2, 64))
    assert mlp.activation is traced and seen == [(3, 2, 256)]
    with pytest.raises(ConfigError, match="activation_func is not supported here") as info:
        MLP(llama(), MLPSubmodules(ColumnParallelLinear, RowParallelLinear, activation_func=torch.nn.SiLU))
    assert info.value.params == ("activation_func",)
