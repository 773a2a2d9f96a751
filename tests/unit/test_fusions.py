"""Fused kernels against their unfused references (CPU, eager)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.execution_plan import resolve
from megatron.core.fusions.compile import compile_layers
from megatron.core.fusions.linear_cross_entropy import chunk_tokens, linear_cross_entropy
from megatron.core.fusions.triton import KERNELS
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(h, w, t, g):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).float(), t, reduction="none")
    (loss * g).sum().backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("chunk", [None, 1, 5, 16, 100])
def test_linear_cross_entropy_matches_reference_fp32(chunk):
    torch.manual_seed(0)
    n, hid, v = 37, 24, 61
    h = torch.randn(n, hid, requires_grad=True)
    w = torch.randn(v, hid, requires_grad=True)
    t = torch.randint(0, v, (n,))
    g = torch.rand(n)  # a per-token weighting, as a loss mask gives
    loss = linear_cross_entropy(h, w, t, chunk, loss_weights=g)
    ((loss * g).sum() * 0.37).backward()
    ref_loss, ref_h, ref_w = reference(h, w, t, g * 0.37)
    assert loss.dtype == torch.float32 and loss.shape == (n,)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 8])
def test_linear_cross_entropy_bf16_close_and_dtypes(chunk):
    torch.manual_seed(1)
    n, hid, v = 32, 16, 40
    h = torch.randn(n, hid, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, hid, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    g = torch.rand(n)
    loss = linear_cross_entropy(h, w, t, chunk, loss_weights=g)
    (loss * g).sum().backward()
    ref_loss, ref_h, ref_w = reference(h, w, t, g)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel(loss, ref_loss) < 1e-5
    assert rel(h.grad, ref_h) < 1e-2 and rel(w.grad, ref_w) < 1e-2


def test_linear_cross_entropy_keeps_shape_and_checks_tokens():
    h = torch.randn(4, 3, 8)
    w = torch.randn(10, 8)
    t = torch.randint(0, 10, (4, 3))
    assert linear_cross_entropy(h, w, t, chunk=5).shape == (4, 3)
    with pytest.raises(ValueError, match="tokens"):
        linear_cross_entropy(h, w, t[:2])


def test_linear_cross_entropy_default_weights_and_no_grad():
    torch.manual_seed(2)
    h = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (12,))
    linear_cross_entropy(h, w, t, chunk=5).mean().backward()
    ref_loss, ref_h, ref_w = reference(h, w, t, torch.full((12,), 1 / 12))
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk=5), ref_loss, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_rejects_gradient_not_proportional_to_weights():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    t = torch.randint(0, 9, (6,))
    loss = linear_cross_entropy(h, w, t, loss_weights=torch.ones(6))
    with pytest.raises(RuntimeError, match="one scalar times loss_weights"):
        (loss * torch.arange(6.0)).sum().backward()


def test_chunk_tokens_is_a_power_of_two_near_two_gib_of_bf16_logits():
    assert chunk_tokens(8192, 128256) == 8192  # llama-3b: one chunk
    assert chunk_tokens(16384, 50304) == 16384  # gpt-1.3b: one chunk
    assert chunk_tokens(32768, 128256) == 8192
    assert chunk_tokens(10, 128256) == 10


def tiny(**kw):
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_query_groups=2,
    )
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_model_fused_loss_and_grads_match_unfused(tied):
    models = [
        GPTModel(
            tiny(cross_entropy_loss_fusion=fused, share_embeddings_and_output_weights=tied),
            get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
            seed=3,
        )
        for fused in (True, False)
    ]
    assert models[0].fused_cross_entropy and not models[1].fused_cross_entropy
    ids, labels = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    losses = []
    mask = torch.linspace(0.1, 1.0, 16).expand(3, 16)
    for m in models:
        loss = m(ids, None, None, labels=labels, loss_mask=mask)
        assert loss.shape == (3, 16)
        (loss * mask).sum().backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_layers_share_one_graph_and_match_eager():
    torch._dynamo.reset()
    cfg = tiny(num_layers=3)
    eager, comp = (
        GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, seed=5)
        for _ in range(2)
    )
    assert compile_layers([comp], TransformerLayer) == 3
    for layer in comp.modules():  # the CPU CI has no C++ toolchain guarantee: trace only
        if isinstance(layer, TransformerLayer):
            layer.compile(backend="aot_eager", dynamic=False)
    ids = torch.randint(0, 64, (2, 16))
    for m in (eager, comp):
        m(ids, None, None, labels=ids).sum().backward()
    for a, b in zip(eager.parameters(), comp.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    torch._dynamo.reset()


def kernel_report(config):
    """The start-up report of ``config``'s execution plan on the CPU."""
    return resolve(
        config, "cpu", triton_checks=dict.fromkeys(KERNELS, "not a CUDA device (cpu)")
    ).report_lines()


def test_kernel_report_names_every_part_on_cpu():
    lines = kernel_report(tiny(cross_entropy_loss_fusion=True))
    text = "\n".join(lines)
    assert lines[0] == " > kernels:"
    for part in (
        "attention: SDPA",
        "not compiled: CPU run",
        "fused output layer",
        "FP8: off",
        "Transformer Engine",
        "optimizer: AdamW, one pass per tensor",
        "recompute: off",
        "SwiGLU unfused",
    ):
        assert part in text
    for fusion, says in ((True, "GELU (tanh approximation"), (False, "GELU (exact erf)")):
        gelu = kernel_report(tiny(activation="gelu", add_bias_linear=True, bias_gelu_fusion=fusion))
        assert any(says in ln for ln in gelu)
    selective = kernel_report(tiny(recompute_granularity="selective"))
    assert any("recompute: selective" in ln and "--recompute-granularity full" in ln for ln in selective)


# ------------------------------------------------------------------------------------------------
# The kernel choice is the caller's (the execution plan's): self-checks only when asked, every entry
# point told explicitly which implementation runs, a kernel's failure propagates.


def test_triton_kernels_names_the_kernels_a_run_dispatches_to():
    from megatron.core.fusions.triton import KERNELS, NO_KERNELS, TritonKernels

    assert KERNELS == ("swiglu", "cross_entropy", "fp8_cast", "swiglu_fp8")
    assert not any(NO_KERNELS.uses(k) for k in KERNELS) and NO_KERNELS == TritonKernels()
    kernels = TritonKernels(frozenset({"fp8_cast", "swiglu"}))
    assert [k for k in KERNELS if kernels.uses(k)] == ["swiglu", "fp8_cast"]
    with pytest.raises(AssertionError, match="unknown Triton kernels"):
        TritonKernels(frozenset({"swiglu_backward"}))


def test_self_check_reports_why_each_kernel_cannot_run_and_remembers_nothing(monkeypatch):
    from megatron.core.fusions import triton as kt

    cpu = torch.device("cpu")
    assert kt.self_check(cpu) == dict.fromkeys(kt.KERNELS, "not a CUDA device (cpu)")
    calls = []

    def failing(device):
        calls.append("cross_entropy")
        raise RuntimeError("no kernel image")

    checks = {
        "swiglu": lambda d: calls.append("swiglu") or "",
        "cross_entropy": failing,
        "fp8_cast": lambda d: calls.append("fp8_cast") or "fp8 amax differs from the torch code",
        "swiglu_fp8": lambda d: calls.append("swiglu_fp8") or "",
    }
    monkeypatch.setattr(kt, "SELF_CHECKS", checks)
    results = kt.self_check(cpu, interpret=True)  # the interpreter runs kernels on CPU tensors
    assert results == {
        "swiglu": None,
        "cross_entropy": "its self-check failed: RuntimeError: no kernel image",
        "fp8_cast": "disagrees with the torch code: fp8 amax differs from the torch code",
        "swiglu_fp8": None,
    }
    assert kt.passed(results, interpret=True) == kt.TritonKernels(frozenset({"swiglu", "swiglu_fp8"}), True)
    assert kt.self_check(cpu, interpret=True) == results and calls == list(kt.KERNELS) * 2  # checked again
    monkeypatch.setattr(kt, "triton", None)
    assert kt.self_check(torch.device("cuda"), interpret=True) == dict.fromkeys(
        kt.KERNELS, "Triton is not importable"
    )


def test_maybe_compiled_compiles_only_when_the_caller_asks_on_cuda_tensors(monkeypatch):
    from megatron.core.fusions import compile as compile_mod

    compiled = []

    def fake_compile(fn, dynamic):
        compiled.append(dynamic)
        return lambda *a: ("compiled", fn(*a))

    monkeypatch.setattr(compile_mod.torch, "compile", fake_compile)
    monkeypatch.setattr(compile_mod, "raise_recompile_limits", lambda: None)
    helper = compile_mod.maybe_compiled(lambda a, b: a + b, dynamic=True)

    class CudaLike(float):
        is_cuda = True

    assert helper(torch.tensor(1.0), torch.tensor(2.0), compile=True) == 3.0  # a CPU tensor stays eager
    assert helper(CudaLike(1.0), 2.0, compile=False) == 3.0 and compiled == []
    assert helper(CudaLike(1.0), 2.0, compile=True) == ("compiled", 3.0)
    assert helper(CudaLike(1.0), 5.0, compile=True) == ("compiled", 6.0)
    assert compiled == [True]  # one torch.compile wrapper, made on the first compiled call


@pytest.mark.parametrize("use_triton", [False, True])
def test_linear_cross_entropy_runs_the_kernel_it_is_told_and_a_failing_kernel_propagates(
    monkeypatch, use_triton
):
    from megatron.core.fusions import linear_cross_entropy as lce

    ran = []

    def kernel(logits, target, weights):
        ran.append("triton")
        return lce.loss_and_dlogits_(logits, target, weights)

    monkeypatch.setattr(lce, "cross_entropy_grad_triton", kernel)
    torch.manual_seed(0)
    h = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (12,))
    ref = linear_cross_entropy(h, w, t, chunk=5)
    assert ran == []  # the default: the torch code
    got = linear_cross_entropy(h, w, t, chunk=5, use_triton=use_triton)
    assert ran == (["triton"] * 3 if use_triton else []) and torch.equal(got, ref)

    def broken(logits, target, weights):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(lce, "cross_entropy_grad_triton", broken)
    if use_triton:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            linear_cross_entropy(h, w, t, chunk=5, use_triton=True)


def test_swiglu_implementations():
    from megatron.core.fusions.swiglu import swiglu_torch
    from megatron.core.fusions.triton.swiglu import swiglu_backward_torch, swiglu_fp32

    x = (torch.randn(4, 3, 2 * 16) * 3).bfloat16().requires_grad_()
    gate, up = x.detach().chunk(2, dim=-1)
    assert torch.equal(swiglu_torch(x), F.silu(gate) * up)  # the torch ops, in the input's dtype
    g = torch.randn(4, 3, 16).bfloat16()
    xf = x.detach().float().requires_grad_()
    (F.silu(xf[..., :16]) * xf[..., 16:]).backward(g.float())
    torch.testing.assert_close(swiglu_backward_torch(g, x.detach()).float(), xf.grad, rtol=1e-2, atol=1e-2)
    assert torch.equal(swiglu_fp32(x.detach()), (F.silu(gate.float()) * up.float()).bfloat16())


def test_kernel_report_names_document_masked_and_context_parallel_attention():
    plan = resolve(tiny(), "cpu", triton_checks=dict.fromkeys(KERNELS, "not a CUDA device (cpu)"))
    attention = next(ln for ln in plan.report_lines(documents=True) if "attention:" in ln)
    assert "document-masked: SDPA with the documents' dense mask" in attention
    assert "document-masked" not in next(ln for ln in plan.report_lines() if "attention:" in ln)
