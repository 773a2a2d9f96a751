"""FP8 linears: numerics against the bf16/fp32 matmul, delayed-scaling history, the layer hook, flags."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.core import execution_plan as plan_mod
from megatron.core.execution_plan import resolve
from megatron.core.fusions import fp8 as fp8_mod
from megatron.core.fusions.fp8 import (
    DY,
    E4M3,
    E5M2,
    Fp8Gemm,
    Fp8Recipe,
    W,
    X,
    fp8_matmul,
    quantize,
    scale_from_amax,
    scaled_mm,
)
from megatron.core.fusions.fp8 import gemm as fp8_gemm_mod
from megatron.core.fusions.fp8 import swiglu_mlp as fp8_swiglu_mod
from megatron.core.fusions.triton import KERNELS
from megatron.core.fusions.triton.swiglu import swiglu_backward_torch, swiglu_fp32
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_run_config
from tests.fp8_reference import fp8_matmul_reference, tensor_scale
from tests.host_transfers import HostTransfers

pytestmark = pytest.mark.filterwarnings("ignore:FP8 emulated on the CPU")
NO_TRITON = dict.fromkeys(KERNELS, "not a CUDA device (cpu)")
ALL_TRITON = dict.fromkeys(KERNELS)


def _pretend_hopper(monkeypatch) -> None:
    """The execution plan's device check passes on the CPU (the GEMMs still run on the CPU's paths)."""
    monkeypatch.setattr(plan_mod, "fp8_device_error", lambda device, emulated=False: None)


def fp8_plan(cfg, monkeypatch=None, scaled_mm: bool = False, triton_checks=None):
    """The execution plan of ``cfg`` on the CPU: FP8 emulated (the reference GEMMs), or with
    ``scaled_mm`` the device check passed (``monkeypatch``) and the GEMMs on ``torch._scaled_mm``."""
    if scaled_mm:
        _pretend_hopper(monkeypatch)
    return resolve(
        cfg,
        "cpu",
        triton_checks=NO_TRITON if triton_checks is None else triton_checks,
        fp8_emulate=not scaled_mm,
    )


def fp8_gpt(plan, **kw) -> GPTModel:
    """The GPT model of ``plan`` (built from its layer specs, as the trainer builds it)."""
    return GPTModel(
        plan.config,
        get_gpt_decoder_block_plan_spec(plan),
        vocab_size=128,
        max_sequence_length=32,
        seed=1,
        execution_plan=plan,
        **kw,
    )


def fp8_gemm_count(model) -> int:
    return sum(isinstance(m, Fp8Gemm) for m in model.modules())


def without_swiglu_block(plan):
    """``plan`` with the SwiGLU MLPs' FP8 block off: fc1 and fc2 as two FP8 linears."""
    return dataclasses.replace(plan, fp8=dataclasses.replace(plan.fp8, swiglu_block=False))


def _scaled_mm_on_cpu() -> bool:
    try:
        a = torch.zeros(16, 16).to(E4M3)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.bfloat16
        )
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


SCALED_MM = _scaled_mm_on_cpu()
# The reference path (dequantised fp8 in fp32) always; torch._scaled_mm too where this torch runs it on CPU.
PATHS = [False, True] if SCALED_MM else [False]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(m=64, k=96, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(m, n, generator=g).bfloat16()
    return x, w, dy


@pytest.mark.parametrize("use_scaled_mm", PATHS)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_matmul_matches_high_precision(fmt, recipe, use_scaled_mm):
    """e4m3 keeps 3 mantissa bits (~3.7% relative error measured), e5m2 gradients 2 bits (~6%)."""
    r = Fp8Recipe(fmt, recipe, 16, "max")
    x, w, dy = inputs()
    hist, init = torch.zeros(3, 16), torch.zeros(3, dtype=torch.bool)
    y = fp8_matmul_reference(x, w, r, hist, init, use_scaled_mm)
    y.backward(dy)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (xr @ wr.t()).backward(dy.float())
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    grad_bound = 0.09 if fmt == "hybrid" else 0.06
    assert rel(y, xr @ wr.t()) < 0.06
    assert rel(x.grad, xr.grad) < grad_bound
    assert rel(w.grad, wr.grad) < grad_bound


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_gradients_use_the_format_of_the_recipe(fmt):
    """Reference path, checked against a hand-written quantise -> dequantise -> fp32 matmul."""
    r = Fp8Recipe(fmt, "tensorwise")
    assert r.fwd_dtype == E4M3 and r.bwd_dtype == (E5M2 if fmt == "hybrid" else E4M3)
    x, w, dy = inputs()
    fp8_matmul(x, w, r, use_scaled_mm=False).backward(dy)

    def dq(t, dtype):
        s = scale_from_amax(t.float().abs().amax(), dtype)
        return quantize(t, s, dtype).float() / s

    xq, wq, gq = dq(x.detach(), E4M3), dq(w.detach(), E4M3), dq(dy, r.bwd_dtype)
    torch.testing.assert_close(x.grad.float(), (gq @ wq).bfloat16().float(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(w.grad.float(), (gq.t() @ xq).bfloat16().float(), rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not SCALED_MM, reason="torch._scaled_mm does not run on this CPU")
def test_scaled_mm_matches_reference_path():
    """The GPU call and the reference differ only in accumulation order and the final bf16 rounding."""
    x, w, _ = inputs(m=32, k=64, n=48)
    sx, sw = scale_from_amax(x.detach().abs().amax(), E4M3), scale_from_amax(w.detach().abs().amax(), E4M3)
    x8, w8 = quantize(x.detach(), sx, E4M3), quantize(w.detach(), sw, E4M3)
    got = scaled_mm(x8, w8.t(), 1 / sx, 1 / sw, torch.bfloat16, use_scaled_mm=True)
    ref = scaled_mm(x8, w8.t(), 1 / sx, 1 / sw, torch.bfloat16, use_scaled_mm=False)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_quantize_saturates_and_zero_amax_scales_by_one():
    t = torch.tensor([1.0, -1000.0, 0.5])
    q = quantize(t, torch.tensor(1.0), E4M3).float()
    assert q.tolist() == [1.0, -448.0, 0.5]
    assert scale_from_amax(torch.tensor(0.0), E4M3).item() == 1.0
    assert scale_from_amax(torch.tensor(2.0), E5M2).item() == pytest.approx(57344.0 / 2)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_history(algo):
    """First call: current amax. Later calls: the history (max or most recent), then push the current."""
    r = Fp8Recipe("hybrid", "delayed", 4, algo)
    hist, init = torch.zeros(3, 4), torch.zeros(3, dtype=torch.bool)
    fmax = torch.finfo(E4M3).max
    scales = [tensor_scale(torch.full((4,), a), E4M3, r, hist, init, X).item() for a in (2.0, 1.0, 4.0)]
    assert scales[0] == pytest.approx(fmax / 2.0)  # no history yet
    assert scales[1] == pytest.approx(fmax / 2.0)  # history [2]
    assert scales[2] == pytest.approx(fmax / (2.0 if algo == "max" else 1.0))  # history [1, 2]
    assert hist[X].tolist() == [4.0, 1.0, 2.0, 0.0]
    assert init.tolist() == [True, False, False]
    for a in (8.0, 8.0):  # the history keeps its length: the oldest entry falls out
        tensor_scale(torch.full((4,), a), E4M3, r, hist, init, X)
    assert hist[X].tolist() == [8.0, 8.0, 4.0, 1.0]


def test_delayed_history_updates_in_forward_and_backward():
    gemm = Fp8Gemm(Fp8Recipe("hybrid", "delayed", 8), use_scaled_mm=False)
    x, w, dy = inputs(m=32)
    for step in range(2):
        gemm(x, w, None).backward(dy * (step + 1))
    h = gemm.amax_history
    torch.testing.assert_close(h[X, :2], x.detach().float().abs().amax().repeat(2))
    torch.testing.assert_close(h[W, :2], w.detach().float().abs().amax().repeat(2))
    amax_dy = dy.float().abs().amax()
    torch.testing.assert_close(h[DY, :2], torch.stack([2 * amax_dy, amax_dy]))
    assert h[:, 2:].abs().sum() == 0 and gemm.initialized.all()
    assert list(gemm.state_dict()) == []  # compute state only: never in checkpoints


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_linear_steps_without_host_sync(recipe):
    """Forward, backward and the delayed history update never wait for the GPU: a ``t[i] = True`` in the
    amax hook cost three stream syncs per linear (312 per llama-3b step, 76 ms of idle GPU on an H200)."""
    gemm = Fp8Gemm(Fp8Recipe("hybrid", recipe, 4), use_scaled_mm=False)
    x, w, dy = inputs(m=32)
    gemm(x, w, None).backward(dy)  # the first step (no history yet) too
    with HostTransfers() as rec:
        for _ in range(2):
            gemm(x, w, None).backward(dy)
    assert rec.seen == []
    if recipe == "delayed":
        assert gemm.initialized.all() and gemm.amax_history[:, :3].gt(0).all()  # the hook did record


def tiny_config(**kw):
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
        bf16=True,
        fp8_amax_history_len=1024,
        fp8_amax_compute_algo="max",
    )  # the training application's defaults
    base.update(kw)
    return TransformerConfig(**base)


def test_layers_without_fp8_are_bitwise_unchanged():
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, 96, init_std=0.02, bias=True, params_dtype=torch.bfloat16)
    row = RowParallelLinear(96, 64, init_std=0.02, bias=True, params_dtype=torch.bfloat16)
    for p in list(col.parameters()) + list(row.parameters()):
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(8, 2, 64).bfloat16()
    assert col.fp8 is None and row.fp8 is None
    h, _ = col(x)
    assert torch.equal(h, F.linear(x, col.weight, col.bias))
    out, _ = row(h)
    assert torch.equal(out, F.linear(h, row.weight) + row.bias)
    assert set(col.state_dict()) == {"weight", "bias"} and set(row.state_dict()) == {"weight", "bias"}


def test_layer_hook_runs_fp8_and_falls_back_on_unaligned_tokens():
    torch.manual_seed(0)
    ref = {
        k: v.clone() for k, v in ColumnParallelLinear(64, 96, init_std=0.02, bias=True).state_dict().items()
    }
    col = ColumnParallelLinear(
        64,
        96,
        init_std=0.02,
        bias=True,
        params_dtype=torch.bfloat16,
        fp8_gemm=lambda device: Fp8Gemm(
            Fp8Recipe("hybrid", "tensorwise"), device=device, use_scaled_mm=False
        ),
    )
    for p in col.parameters():
        torch.nn.init.normal_(p, std=0.02)
    assert isinstance(col.fp8, Fp8Gemm)
    x = torch.randn(8, 2, 64).bfloat16()  # 16 tokens
    out, _ = col(x)
    assert out.shape == (8, 2, 96) and rel(out, F.linear(x, col.weight, col.bias)) < 0.06
    assert col.state_dict().keys() == ref.keys()
    x_odd = torch.randn(5, 3, 64).bfloat16()  # 15 tokens: not a multiple of 16
    with pytest.warns(UserWarning, match="not a multiple of 16"):
        out, _ = col(x_odd)
    assert torch.equal(out, F.linear(x_odd, col.weight, col.bias))


def test_fp8_plan_refuses_the_cpu():
    cfg = tiny_config(fp8_format="hybrid")
    with pytest.raises(ValueError, match=r"fp8_format needs an H100/H200-class GPU.*CPU"):
        resolve(cfg, "cpu", triton_checks=NO_TRITON)
    plan = resolve(tiny_config(), "cpu", triton_checks=NO_TRITON)  # FP8 off: nothing to check
    assert plan.fp8 is None and fp8_gemm_count(fp8_gpt(plan)) == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_plan_covers_the_transformer_linears_only(monkeypatch, recipe):
    cfg = tiny_config(fp8_format="hybrid", fp8_recipe=recipe, fp8_amax_history_len=16)
    ref = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32, seed=1)
    model = fp8_gpt(fp8_plan(cfg, monkeypatch, scaled_mm=SCALED_MM))
    keys = set(ref.state_dict())
    assert fp8_gemm_count(model) == 4 * cfg.num_layers
    assert all(m.use_scaled_mm == SCALED_MM for m in model.modules() if isinstance(m, Fp8Gemm))
    assert set(model.state_dict()) == keys
    assert model.output_layer.fp8 is None
    names = {n.rsplit(".", 2)[-2] for n, m in model.named_modules() if isinstance(m, Fp8Gemm)}
    assert names == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    ids = torch.randint(0, 128, (2, 16))
    losses = []
    for m in (ref, model):
        loss = m(ids, None, None, labels=ids).float().mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    g_ref = ref.decoder.layers[0].mlp.linear_fc1.weight.grad
    g = model.decoder.layers[0].mlp.linear_fc1.weight.grad
    assert g.dtype == torch.bfloat16 and rel(g, g_ref) < 0.15


def test_fp8_plan_warns_and_skips_unaligned_weights(monkeypatch):
    cfg = tiny_config(fp8_format="e4m3", ffn_hidden_size=72)  # fc1 [144, 64], fc2 [64, 72]
    with pytest.warns(UserWarning, match="linear_fc2"):
        plan = fp8_plan(cfg, monkeypatch, scaled_mm=True)
    model = fp8_gpt(plan)
    assert fp8_gemm_count(model) == 3 * cfg.num_layers
    assert model.decoder.layers[0].mlp.linear_fc2.fp8 is None


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_evaluation_forward_equals_the_training_forward_without_transposed_copies(monkeypatch, recipe):
    """Under no_grad (evaluation) an FP8 linear gives the training forward's output bit for bit, from
    the same scales (delayed: before and after the history has entries), without the cast-transposes
    that write the fp8 copies only a backward reads, and records nothing."""
    gemm = Fp8Gemm(Fp8Recipe("hybrid", recipe, 4), device="cpu", use_scaled_mm=False)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=g) * 3).bfloat16()
    w = (torch.randn(48, 64, generator=g) * 0.05).bfloat16()

    def train_forward():
        out = gemm(x.clone().requires_grad_(), w.clone().requires_grad_(), None)
        out.float().square().sum().backward()  # records the amaxes (delayed)
        return out.detach()

    def eval_forward():
        before = gemm.amax_history.clone()
        with torch.no_grad(), monkeypatch.context() as m:
            for name in ("fp8_cast_transpose", "fp8_cast_transpose_amax"):
                m.setattr(
                    fp8_gemm_mod, name, lambda *a, **k: pytest.fail("evaluation wrote transposed fp8 copies")
                )
            out = gemm(x, w, None)
        assert torch.equal(gemm.amax_history, before)  # nothing recorded
        return out

    for _ in range(3):  # delayed: cold history (current amaxes), then the history's
        warm = gemm.warm
        evaluated = eval_forward()
        assert gemm.warm == warm
        assert torch.equal(evaluated, train_forward())
    assert recipe == "tensorwise" or gemm.warm


def test_first_last_layers_bf16_keeps_those_layers_out_of_fp8(monkeypatch):
    """Megatron's --first-last-layers-bf16: the first / last N layers of the whole model keep bf16 GEMMs,
    chosen by global layer number (a later pipeline stage's layers count from its offset)."""
    cfg = tiny_config(
        num_layers=5,
        fp8_format="hybrid",
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=2,
        num_layers_at_end_in_bf16=1,
    )
    assert fp8_mod.bf16_layer_numbers(cfg) == {1, 2, 5}
    plan = fp8_plan(cfg, monkeypatch, scaled_mm=True)
    model = fp8_gpt(plan)
    assert fp8_gemm_count(model) == 4 * 2
    for layer in model.decoder.layers:
        fp8 = [getattr(layer.self_attention, n).fp8 for n in ("linear_qkv", "linear_proj")]
        fp8 += [getattr(layer.mlp, n).fp8 for n in ("linear_fc1", "linear_fc2")]
        assert all((f is None) == (layer.layer_number in (1, 2, 5)) for f in fp8), layer.layer_number
    # the last stage of a two-stage pipeline over the same 5 layers holds layers 4 and 5
    stage = fp8_gpt(plan, pre_process=False, num_layers=2, layer_offset=3)
    assert [layer.layer_number for layer in stage.decoder.layers] == [4, 5]
    assert fp8_gemm_count(stage) == 4
    assert (
        stage.decoder.layers[0].mlp.linear_fc1.fp8 is not None
        and stage.decoder.layers[1].mlp.linear_fc1.fp8 is None
    )
    # off: every layer in FP8
    cfg.first_last_layers_bf16 = False
    assert fp8_gemm_count(fp8_gpt(fp8_plan(cfg, monkeypatch, scaled_mm=True))) == 4 * 5


def test_first_last_layers_bf16_flags_and_errors(monkeypatch):
    m = parse_run_config(BASE + ["--dry-run"]).model
    assert (m.first_last_layers_bf16, m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16) == (
        False,
        1,
        1,
    )
    argv = (
        BASE[:1] + ["4"] + BASE[2:] + "--bf16 --fp8-format hybrid --dry-run --first-last-layers-bf16".split()
    )
    m = parse_run_config(argv + "--num-layers-at-end-in-bf16 2".split()).model
    assert (m.first_last_layers_bf16, m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16) == (
        True,
        1,
        2,
    )
    with pytest.raises(ValueError, match="keeps all 4 layers in bf16; keep fewer \\(together at most 3\\)"):
        parse_run_config(argv + "--num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 2".split())
    with pytest.raises(ValueError, match="--num-layers-at-start-in-bf16 -1: give a count"):
        parse_run_config(argv + "--num-layers-at-start-in-bf16 -1".split())
    line = fp8_report_line(
        tiny_config(fp8_format="hybrid", first_last_layers_bf16=True), monkeypatch, fp8_linears=8
    )
    assert "the first 1 and last 1 transformer layers in bf16: --first-last-layers-bf16" in line


BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()


def test_fp8_flags_defaults_and_values():
    m = parse_run_config(BASE).model
    assert (m.fp8_format, m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo) == (
        None,
        "delayed",
        1024,
        "max",
    )
    m = parse_run_config(
        BASE
        + "--bf16 --fp8-format e4m3 --fp8-recipe tensorwise --fp8-amax-history-len 16 "
        "--fp8-amax-compute-algo most_recent --dry-run".split()
    ).model
    assert Fp8Recipe.from_config(m) == Fp8Recipe("e4m3", "tensorwise", 16, "most_recent")


def test_fp8_needs_bf16():
    with pytest.raises(ValueError, match="--fp8-format hybrid needs --bf16"):
        parse_run_config(BASE + "--fp8-format hybrid".split())
    with pytest.raises(ValueError, match="--bf16"):
        parse_run_config(BASE + "--fp16 --fp8-format e4m3".split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_fp8_on_a_machine_without_gpu_fails_before_training():
    with pytest.raises(ValueError, match="--fp8-format hybrid needs an H100/H200-class GPU"):
        parse_run_config(BASE + "--bf16 --fp8-format hybrid".split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only switch")
def test_emulation_switch_lets_tests_run_fp8_on_the_cpu(monkeypatch):
    """MEGATRON_FP8_EMULATE=1 (tests of the layouts) lets a CPU run use FP8 with emulated GEMMs and
    says so; without it the CPU is refused (previous test)."""
    cfg = tiny_config(fp8_format="hybrid")
    cpu = torch.device("cpu")
    assert (
        not fp8_mod.fp8_emulated(cpu) and fp8_mod.fp8_device_error(cpu, fp8_mod.fp8_emulated(cpu)) is not None
    )
    monkeypatch.setenv("MEGATRON_FP8_EMULATE", "1")
    assert fp8_mod.fp8_emulated(cpu) and fp8_mod.fp8_device_error(cpu, fp8_mod.fp8_emulated(cpu)) is None
    parse_run_config(BASE + "--bf16 --fp8-format hybrid".split())  # no error at parse time either
    with pytest.warns(UserWarning, match="emulated on the CPU"):
        plan = resolve(cfg, cpu, triton_checks=NO_TRITON, fp8_emulate=fp8_mod.fp8_emulated(cpu))
    model = fp8_gpt(plan)
    assert fp8_gemm_count(model) == 4 * cfg.num_layers
    assert all(not m.use_scaled_mm for m in model.modules() if isinstance(m, Fp8Gemm))
    lines = plan.report_lines(fp8_linears=8)
    assert any(
        "FP8: emulated on the CPU" in line and "for 8 QKV/proj/fc1/fc2 linears" in line for line in lines
    )


def fp8_report_line(cfg, monkeypatch, fp8_linears=None, triton=False) -> str:
    """The report's FP8 line of a (pretended Hopper) plan of ``cfg``; ``triton``: every kernel passed."""
    plan = fp8_plan(cfg, monkeypatch, scaled_mm=True, triton_checks=ALL_TRITON if triton else NO_TRITON)
    return next(line for line in plan.report_lines(fp8_linears=fp8_linears) if "FP8:" in line)


def test_kernel_report_says_whether_fp8_is_on(monkeypatch):
    def fp8_line(cfg, **kw):
        return fp8_report_line(cfg, monkeypatch, **kw)

    def fp8_line_of(cfg, have_triton):
        return fp8_report_line(cfg, monkeypatch, triton=have_triton)

    assert "FP8: off" in fp8_line(tiny_config())
    line = fp8_line(tiny_config(fp8_format="hybrid", fp8_recipe="delayed"), fp8_linears=8)
    assert (
        "FP8: on" in line and "e5m2 gradients" in line and "delayed scaling (amax history 1024, max)" in line
    )
    assert "8 QKV/proj/fc1/fc2 linears" in line
    line = fp8_line(tiny_config(fp8_format="e4m3", fp8_recipe="tensorwise"))
    assert "tensorwise" in line and "e4m3 gradients" in line
    # who quantises (the report is asked on the CPU here: no Triton on that device)
    assert "quantised by torch code (Triton kernel fp8_cast: not a CUDA device (cpu))" in line
    assert "quantised by Triton cast-transpose kernels" in fp8_line_of(tiny_config(fp8_format="hybrid"), True)
    assert "quantised by torchao's casts" in fp8_line_of(
        tiny_config(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_gemm_impl="torchao"), True
    )
    fused = "SwiGLU's output and its gradient are quantised inside SwiGLU's own passes"
    assert fused in fp8_line_of(tiny_config(fp8_format="hybrid"), True)  # delayed, SwiGLU, no bias
    for other in (dict(fp8_recipe="tensorwise"), dict(activation="gelu"), dict(add_bias_linear=True)):
        assert fused not in fp8_line_of(tiny_config(fp8_format="hybrid", **other), True), other


def test_fp8_matmul_emits_no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8_matmul(*inputs()[:2], Fp8Recipe("e4m3", "tensorwise"), use_scaled_mm=False)


def _delayed_steps(gemm_fn, steps=3, algo="max"):
    """(outputs, x grads, w grads, history) of ``steps`` forward/backward calls of a delayed-scaling GEMM."""
    x, w, dy = inputs(m=32)
    outs, dxs, dws = [], [], []
    for step in range(steps):
        xs, ws = x.detach().mul(step + 1).requires_grad_(), w.detach().requires_grad_()
        y = gemm_fn(xs, ws)
        y.backward(dy * (3 - step))
        outs.append(y.detach())
        dxs.append(xs.grad)
        dws.append(ws.grad)
    return outs, dxs, dws


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_layer_delayed_path_matches_the_eager_reference(algo):
    """Fp8Gemm's compile-friendly delayed path (scales read from the history, amaxes recorded outside
    the autograd function) gives the eager reference's outputs, gradients and history, step by step."""
    recipe = Fp8Recipe("hybrid", "delayed", 4, algo)
    hist, init = torch.zeros(3, 4), torch.zeros(3, dtype=torch.bool)
    ref = _delayed_steps(
        lambda x, w: fp8_matmul_reference(x, w, recipe, hist, init, use_scaled_mm=False), algo=algo
    )
    gemm = Fp8Gemm(recipe, use_scaled_mm=False)
    got = _delayed_steps(lambda x, w: gemm(x, w, None), algo=algo)
    for a, b in zip(got, ref):
        for t, r in zip(a, b):
            assert torch.equal(t, r)
    assert torch.equal(gemm.amax_history, hist) and torch.equal(gemm.initialized, init)
    assert gemm.amax_sink is not None and gemm.amax_sink.grad is None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_layer_delayed_path_compiles_without_graph_breaks(backend):
    """The delayed path inside torch.compile (fullgraph: no break at the FP8 GEMM) updates the history
    like eager code and gives the same results (reference matmul path on the CPU)."""
    recipe = Fp8Recipe("hybrid", "delayed", 4, "max")
    eager, compiled = Fp8Gemm(recipe, use_scaled_mm=False), Fp8Gemm(recipe, use_scaled_mm=False)
    fn = torch.compile(lambda x, w: compiled(x, w, None), backend=backend, fullgraph=True)
    ref = _delayed_steps(lambda x, w: eager(x, w, None))
    got = _delayed_steps(fn)
    for a, b in zip(got, ref):
        for t, r in zip(a, b):
            torch.testing.assert_close(t, r, rtol=0, atol=0)
    assert torch.equal(compiled.amax_history, eager.amax_history)
    assert compiled.initialized.all() and compiled.amax_history[:, :3].gt(0).all()


def _delayed_fp8_gpt(monkeypatch, swiglu_block: bool = True, **config) -> GPTModel:
    """A tiny GPT with delayed-scaling FP8 linears (or ``config``'s recipe) on the CPU (emulated: the
    reference matmul path), built from its execution plan (``swiglu_block`` False: the SwiGLU MLPs as
    two FP8 linears); its TransformerLayer.compile is aot_eager with fullgraph (a graph break fails)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    monkeypatch.setattr(
        TransformerLayer,
        "compile",
        lambda self, **kw: torch.nn.Module.compile(self, backend="aot_eager", fullgraph=True),
    )
    cfg = tiny_config(
        **{"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4, **config}
    )
    plan = fp8_plan(cfg)
    return fp8_gpt(plan if swiglu_block or plan.fp8 is None else without_swiglu_block(plan))


def _three_steps(model: GPTModel) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    """(losses, weight gradients of the last step, amax histories) after three forward/backward steps."""
    losses = []
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        for p in model.parameters():
            p.grad = None
        loss = model(ids, None, None, labels=ids).float().mean()
        loss.backward()
        losses.append(loss.item())
    return (
        losses,
        [p.grad for p in model.parameters() if p.grad is not None],
        [g.amax_history.clone() for g in model.modules() if isinstance(g, Fp8Gemm)],
    )


def test_compiled_layers_with_delayed_fp8_train_like_eager_ones(monkeypatch):
    """Whole transformer layers compiled (fullgraph: the FP8 GEMMs no longer break the graph) with
    delayed scaling: three steps give eager's losses, weight gradients and amax histories."""
    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    models = [_delayed_fp8_gpt(monkeypatch) for _ in range(2)]
    assert compile_layers([models[1]], TransformerLayer) == models[1].config.num_layers
    (l0, g0, h0), (l1, g1, h1) = [_three_steps(m) for m in models]
    assert l1 == l0
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
    assert len(h1) == 4 * models[1].config.num_layers and all(torch.equal(a, b) for a, b in zip(h1, h0))
    assert all(h[:, :3].gt(0).all() for h in h1)
    # an evaluation forward (no gradients: the FP8 forward without transposed copies) compiles fullgraph too
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        eager_eval, compiled_eval = (m(ids, None, None, labels=ids) for m in models)
    assert torch.equal(compiled_eval, eager_eval)


def test_compiled_layers_with_bf16_first_layer_train_like_eager_ones(monkeypatch):
    """--first-last-layers-bf16 under compiled layers: the bf16 layer and the FP8 layers share the
    code but not the graph (three graphs: bf16, FP8 cold, FP8 warm), and three steps equal eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch._dynamo.reset()
    config = dict(
        num_layers=3, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0
    )
    models = [_delayed_fp8_gpt(monkeypatch, **config) for _ in range(2)]
    assert [layer.mlp.linear_fc1.fp8 is None for layer in models[1].decoder.layers] == [True, False, False]
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(
        TransformerLayer,
        "compile",
        lambda self, **kw: torch.nn.Module.compile(self, backend=counter, fullgraph=True),
    )
    assert compile_layers([models[1]], TransformerLayer) == 3
    (l0, g0, h0), (l1, g1, h1) = [_three_steps(m) for m in models]
    assert l1 == l0 and len(h1) == 2 * 4
    assert all(torch.equal(a, b) for a, b in zip(g1, g0)) and all(torch.equal(a, b) for a, b in zip(h1, h0))
    assert counter.frame_count == 3


@pytest.mark.parametrize("compiled", [False, True])
def test_recompute_keeps_delayed_fp8_bitwise_identical(monkeypatch, compiled):
    """Full activation recompute replays each layer's forward: with delayed scaling the replay must
    quantise with the scales of the original forward and record nothing, so that losses, gradients
    and amax histories equal a run without recompute (the recompute guarantee of docs/parallelism.md)."""
    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    results = []
    for recompute in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ):
        model = _delayed_fp8_gpt(monkeypatch, **recompute)
        if compiled:
            compile_layers([model], TransformerLayer)
        results.append(_three_steps(model))
    (l0, g0, h0), (l1, g1, h1) = results
    assert l1 == l0
    assert all(torch.equal(a, b) for a, b in zip(g1, g0))
    assert all(torch.equal(a, b) for a, b in zip(h1, h0))


# ------------------------------------------------------------------------------------------------
# --fp8-gemm-impl torchao: torchao's float8 training behind the same Fp8Gemm (emulated on the CPU).


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_torchao_gemms_quantise_like_ours(fmt):
    """Same tensorwise quantisation and formats: torchao's outputs and gradients equal our reference's
    up to one bf16 rounding of the emulated GEMM's output, eager and compiled (fullgraph)."""
    pytest.importorskip("torchao.float8")
    x, w, dy = inputs(m=64)
    x, w = x.detach(), w.detach()

    def step(gemm, compile_it=False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = (
            torch.compile(lambda a, b: gemm(a, b, None), fullgraph=True)
            if compile_it
            else (lambda a, b: gemm(a, b, None))
        )
        y = fn(xs, ws)
        y.backward(dy)
        return y.detach(), xs.grad, ws.grad

    ours = step(Fp8Gemm(Fp8Recipe(fmt, "tensorwise", 1, "max", "scaled_mm"), use_scaled_mm=False))
    ao = Fp8Gemm(Fp8Recipe(fmt, "tensorwise", 1, "max", "torchao"), use_scaled_mm=False)
    for got in (step(ao), step(ao, compile_it=True)):
        for g, r in zip(got, ours):
            assert g.dtype == r.dtype and g.shape == r.shape
            torch.testing.assert_close(g, r, rtol=2**-7, atol=1e-5)
    # and not the bf16 GEMM: the quantisation really happened
    assert not torch.allclose(step(ao)[0], (x.float() @ w.float().t()).bfloat16(), rtol=1e-3, atol=1e-4)


def test_torchao_gemm_impl_flag_and_errors(monkeypatch):
    pytest.importorskip("torchao.float8")
    cfg = tiny_config(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_gemm_impl="torchao")
    assert Fp8Recipe.from_config(cfg).gemm_impl == "torchao"
    assert "torchao float8 training" in fp8_report_line(cfg, monkeypatch)
    assert parse_run_config(BASE + ["--dry-run"]).model.fp8_gemm_impl == "scaled_mm"
    with pytest.raises(
        ValueError, match="fp8_gemm_impl torchao runs the tensorwise recipe only.*fp8_recipe tensorwise"
    ):
        tiny_config(fp8_format="hybrid", fp8_recipe="delayed", fp8_gemm_impl="torchao")
    with pytest.raises(ValueError, match="fp8_gemm_impl 'cublas' is not valid"):
        tiny_config(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_gemm_impl="cublas")
    monkeypatch.setitem(
        __import__("sys").modules, "torchao.float8.float8_linear", None
    )  # torchao not importable
    with pytest.raises(ValueError, match="--fp8-gemm-impl torchao needs torchao.*pip install torchao"):
        tiny_config(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_gemm_impl="torchao")


def test_compiled_layers_with_torchao_gemms_train_like_eager_ones(monkeypatch):
    """--fp8-gemm-impl torchao inside whole compiled layers (fullgraph): eager's losses and gradients."""
    pytest.importorskip("torchao.float8")
    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    models = [
        _delayed_fp8_gpt(monkeypatch, fp8_recipe="tensorwise", fp8_gemm_impl="torchao") for _ in range(2)
    ]
    assert all(g._torchao is not None for g in models[0].modules() if isinstance(g, Fp8Gemm))
    assert compile_layers([models[1]], TransformerLayer) == models[1].config.num_layers
    (l0, g0, _), (l1, g1, _) = [_three_steps(m) for m in models]
    assert l1 == l0
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g1, g0))


def test_delayed_fp8_layers_recompile_once_when_the_history_fills(monkeypatch):
    """Delayed scaling's scales depend on the history alone once it has entries (``Fp8Gemm.warm``, a
    host flag, so that no cast waits for its tensor's amax): the compiled layers (two, sharing one
    graph) compile once for the first step and once more after it, never again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch._dynamo.reset()
    model = _delayed_fp8_gpt(monkeypatch)
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(
        TransformerLayer,
        "compile",
        lambda self, **kw: torch.nn.Module.compile(self, backend=counter, fullgraph=True),
    )
    gemms = [g for g in model.modules() if isinstance(g, Fp8Gemm)]
    with torch.no_grad():  # an evaluation forward records nothing and leaves the history cold
        model(torch.zeros(2, 16, dtype=torch.long), None, None)
    assert not any(g.warm for g in gemms)
    assert compile_layers([model], TransformerLayer) == model.config.num_layers
    _three_steps(model)
    assert all(g.warm for g in gemms)
    assert counter.frame_count == 2


# ------------------------------------------------------------------------------------------------
# The SwiGLU MLP as one FP8 block (fc1 -> SwiGLU -> fc2, the activation and its gradient quantised in
# SwiGLU's own passes): the numerics of the two linears apart.


def test_swiglu_mlp_block_is_used_where_it_applies(monkeypatch):
    """Delayed scaling, our GEMMs, SwiGLU, no biases: every MLP gets the block, which shares its two
    linears' FP8 state; tensorwise (the only recipe of torchao's GEMMs), GELU or biased MLPs keep the
    linears' own path."""
    models = {
        name: _delayed_fp8_gpt(monkeypatch, **kw)
        for name, kw in (
            ("fused", {}),
            ("tensorwise", dict(fp8_recipe="tensorwise")),
            ("gelu", dict(activation="gelu")),
            ("bias", dict(add_bias_linear=True)),
        )
    }
    mlps = [layer.mlp for layer in models["fused"].decoder.layers]
    assert all(
        m.fp8_swiglu is not None
        and m.fp8_swiglu.fc1 is m.linear_fc1.fp8
        and m.fp8_swiglu.fc2 is m.linear_fc2.fp8
        for m in mlps
    )
    for name in ("tensorwise", "gelu", "bias"):
        assert all(getattr(layer.mlp, "fp8_swiglu", None) is None for layer in models[name].decoder.layers), (
            name
        )
    # the block holds no state of its own: the model's modules and state dict are those of the linears
    plain = _delayed_fp8_gpt(monkeypatch, swiglu_block=False)
    assert all(getattr(layer.mlp, "fp8_swiglu", None) is None for layer in plain.decoder.layers)
    assert [n for n, _ in models["fused"].named_modules()] == [n for n, _ in plain.named_modules()]
    assert models["fused"].state_dict().keys() == plain.state_dict().keys()


_SWIGLU_FP8_CALLS: list[str] = []


@torch.library.custom_op("test_fp8::record_swiglu_fp8", mutates_args=())
def _record_swiglu_fp8(x: torch.Tensor) -> None:
    """Records a call of the FP8 block's fused SwiGLU casts: when it runs eagerly, and when a compile
    traces it (its fake implementation), like an op whose body the compiled graph inlines."""
    _SWIGLU_FP8_CALLS.append("swiglu_fp8")


@_record_swiglu_fp8.register_fake
def _(x: torch.Tensor) -> None:
    _SWIGLU_FP8_CALLS.append("swiglu_fp8")


class _SwiGLUFp32(torch.autograd.Function):
    """SwiGLU computed in fp32 and rounded once, its backward the same formula (as the FP8 block's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return swiglu_fp32(x)

    @staticmethod
    def backward(ctx, grad):
        return swiglu_backward_torch(grad, ctx.saved_tensors[0])


@pytest.mark.parametrize("compiled", [False, True])
def test_swiglu_mlp_block_trains_like_the_two_linears(monkeypatch, compiled):
    """Three steps (the block runs from the second, once the histories are warm): losses, every weight
    gradient and every amax history equal those of the two FP8 linears with SwiGLU between them
    (computed in fp32 and rounded once, as Inductor's kernel and the block do), eager and compiled
    (fullgraph); an evaluation forward and a cold first step take the linears' path."""
    from megatron.core.fusions.compile import compile_layers
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls = (
        _SWIGLU_FP8_CALLS  # the block's two fused ops, as they run (eager, or traced into the compiled graph)
    )
    calls.clear()
    for name in ("swiglu_cast_transpose_amax", "swiglu_backward_cast_transpose_amax"):
        real = getattr(fp8_swiglu_mod, name)
        monkeypatch.setattr(
            fp8_swiglu_mod, name, lambda *a, _real=real: (_record_swiglu_fp8(a[0]), _real(*a))[1]
        )
    fused, ref = _delayed_fp8_gpt(monkeypatch), _delayed_fp8_gpt(monkeypatch, swiglu_block=False)
    for m in (fused, ref):  # (SwiGLU in fp32 rounded once, as the block computes it; the default is bf16)
        for layer in m.decoder.layers:
            layer.mlp.activation = _SwiGLUFp32.apply
    if compiled:
        for m in (fused, ref):
            compile_layers([m], TransformerLayer)
    with torch.no_grad():  # evaluation, cold: the linears' path
        fused(torch.zeros(2, 16, dtype=torch.long), None, None)
    (l0, g0, h0), (l1, g1, h1) = _three_steps(ref), _three_steps(fused)
    n_layers = fused.config.num_layers
    # eager: steps 2 and 3, forward and backward of every layer's MLP; compiled: the ops are traced into
    # the warm graph (on the CPU their torch code is inlined, so they do not run as calls)
    assert len(calls) == 2 * 2 * n_layers if not compiled else calls
    assert l1 == l0
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
    assert len(h1) == 4 * n_layers and all(torch.equal(a, b) for a, b in zip(h1, h0))
    assert all(h[:, :3].gt(0).all() for h in h1)
    calls.clear()
    with torch.no_grad():  # evaluation, warm: still the linears' path (no transposed copies)
        fused(torch.zeros(2, 16, dtype=torch.long), None, None)
    assert calls == []


# ------------------------------------------------------------------------------------------------
# Which quantisation kernels run is the GEMM's constructor argument (the plan's TritonKernels).


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_gemm_quantises_with_the_kernels_it_was_given(monkeypatch, recipe):
    """``kernels`` with ``fp8_cast``: every cast and amax of forward and backward goes to the Triton ops
    (recorded here, computing the torch code's values); without: none does, and the values are equal.
    A kernel that fails after its self-check passed propagates (no silent fallback)."""
    from megatron.core.fusions.triton import TritonKernels
    from megatron.core.fusions.triton import fp8_cast as fc

    ran = []
    for op, torch_fn in (
        ("_cast_transpose_op", lambda t, s, d: fc.fp8_cast_transpose_torch(t, s, d, False)),
        ("_cast_transpose_amax_op", lambda t, s, d: fc.fp8_cast_transpose_torch(t, s, d, True)),
        ("_amax_op", fc.fp8_amax_torch),
    ):
        monkeypatch.setattr(fc, op, lambda *a, _op=op, _fn=torch_fn: ran.append(_op) or _fn(*a))
    x, w, dy = inputs(m=32)
    results = []
    for kernels in (TritonKernels(), TritonKernels(frozenset({"fp8_cast"}))):
        gemm = Fp8Gemm(Fp8Recipe("hybrid", recipe, 4), use_scaled_mm=False, kernels=kernels)
        for _ in range(2):  # delayed: cold, then warm
            xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            y = gemm(xs, ws, None)
            y.backward(dy)
            results.append((y, xs.grad, ws.grad))
        assert bool(ran) == kernels.uses("fp8_cast")
    for a, b in zip(results[:2], results[2:]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert {"_cast_transpose_op", "_amax_op"} <= set(ran)
    monkeypatch.setattr(
        fc, "_cast_transpose_op", lambda *a: (_ for _ in ()).throw(RuntimeError("kernel failed"))
    )
    gemm = Fp8Gemm(
        Fp8Recipe("hybrid", recipe, 4), use_scaled_mm=False, kernels=TritonKernels(frozenset({"fp8_cast"}))
    )
    with pytest.raises(RuntimeError, match="kernel failed"):
        gemm(x.detach().requires_grad_(), w.detach().requires_grad_(), None).backward(dy)


def test_fp8_swiglu_block_uses_the_fused_kernels_it_was_given(monkeypatch):
    """Fp8SwigluMlp(kernels=...) with ``swiglu_fp8``: the fused SwiGLU casts go to the Triton ops; the
    unaligned fallback runs the activation it was given."""
    from megatron.core.fusions.fp8 import Fp8SwigluMlp
    from megatron.core.fusions.triton import TritonKernels
    from megatron.core.fusions.triton import swiglu_fp8 as sf

    ran = []
    monkeypatch.setattr(
        sf, "_swiglu_op", lambda *a: ran.append("fwd") or sf.swiglu_cast_transpose_amax(*a, False)
    )
    monkeypatch.setattr(
        sf,
        "_swiglu_backward_op",
        lambda *a: ran.append("bwd") or sf.swiglu_backward_cast_transpose_amax(*a, False),
    )
    recipe = Fp8Recipe("hybrid", "delayed", 4)
    fc1, fc2 = Fp8Gemm(recipe, use_scaled_mm=False), Fp8Gemm(recipe, use_scaled_mm=False)
    for gemm in (fc1, fc2):
        gemm.push_amaxes(torch.ones(3))  # warm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(96, 64, generator=g) * 0.05).bfloat16().requires_grad_()
    w2 = (torch.randn(64, 48, generator=g) * 0.05).bfloat16().requires_grad_()
    for kernels, expected in (
        (TritonKernels(), []),
        (TritonKernels(frozenset({"swiglu_fp8"})), ["fwd", "bwd"]),
    ):
        ran.clear()
        block = Fp8SwigluMlp(fc1, fc2, kernels=kernels)
        assert block.ready()
        block(x, w1, w2).float().sum().backward()
        assert ran == expected
    activations = []
    block = Fp8SwigluMlp(fc1, fc2, activation=lambda h: activations.append(h.shape) or h[..., :48])
    with pytest.warns(UserWarning, match="not a multiple of 16"):
        block(x[:15], w1, w2)
    assert activations == [torch.Size([15, 96])]
