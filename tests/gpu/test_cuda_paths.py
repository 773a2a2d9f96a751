"""CUDA-only paths (compiled helpers, mixed-dtype GEMMs), run on the GPU machine:

    python -m pytest tests/gpu -q

The CPU suite skips this file (it needs a CUDA device); the same arithmetic runs eagerly on the
CPU in tests/unit/test_fusions.py and tests/distributed/test_ddp.py.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import distributed_data_parallel as ddp_mod
from megatron.core.fusions.linear_cross_entropy import _accumulate_wgrad, linear_cross_entropy
from megatron.core.fusions.triton import TritonKernels, passed, self_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@functools.cache
def cuda_kernels() -> TritonKernels:
    """The Triton kernels whose self-check passes on this GPU (what the execution plan resolves)."""
    return passed(self_check(torch.device("cuda")))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def test_addmm_accumulates_in_fp32_in_place():
    torch.manual_seed(0)
    acc = torch.randn(64, 32, device="cuda")
    a, b = (
        torch.randn(48, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(48, 32, device="cuda", dtype=torch.bfloat16),
    )
    expected = acc + a.float().t() @ b.float()
    _accumulate_wgrad(acc, a, b)
    assert rel(acc, expected) < 1e-5


@pytest.mark.parametrize("chunk", [None, 512])
def test_fused_cross_entropy_bf16_matches_unfused(chunk):
    torch.manual_seed(1)
    n, hid, v = 2048, 256, 5000
    h = (torch.randn(n, hid, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, hid, device="cuda") * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    mask = (torch.rand(n, device="cuda") > 0.1).float()
    loss = linear_cross_entropy(
        h, w, t, chunk, loss_weights=mask, use_triton=cuda_kernels().uses("cross_entropy"), compile=True
    )
    ((loss * mask).sum() / mask.sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).float(), t, reduction="none")
    ((ref * mask).sum() / mask.sum()).backward()
    assert rel(loss, ref) < 1e-4
    assert rel(h.grad, h2.grad) < 2e-2 and rel(w.grad, w2.grad) < 2e-2


def test_compiled_gradient_accumulation_adds_in_place():
    acc = torch.randn(1000, device="cuda")
    view = acc[100:900]
    before = acc.clone()
    grad = torch.randn(800, device="cuda").bfloat16()
    ddp_mod._accumulate(view, grad, compile=True)
    assert torch.equal(acc[:100], before[:100]) and torch.equal(acc[900:], before[900:])
    torch.testing.assert_close(acc[100:900], before[100:900] + grad.float())
    grad2 = torch.randn(37, device="cuda").bfloat16()  # another length: same graph (dynamic)
    acc2 = torch.zeros(37, device="cuda")
    ddp_mod._accumulate(acc2, grad2, compile=True)
    torch.testing.assert_close(acc2, grad2.float())


def test_compiled_one_pass_adamw_matches_eager_cpu():
    from megatron.core.optimizer.fused_adamw import adamw_step

    results = []
    for dev in ("cpu", "cuda"):
        g = torch.Generator().manual_seed(0)
        mains = [
            torch.nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in [(300, 70), (70,), (5, 3, 2)]
        ]
        models = [m.detach().to(torch.bfloat16) for m in mains]
        opt = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1, fused=dev == "cuda")
        for step in range(4):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
            for m in mains:
                m.grad = torch.randn(m.shape, generator=g).to(dev)
            adamw_step(opt, {id(m): p for m, p in zip(mains, models)}, torch.tensor(2.0, device=dev))
        for m, p in zip(mains, models):  # the model copy is the rounded main param, on each device
            assert torch.equal(p, m.detach().to(torch.bfloat16))
        results.append([m.detach().cpu() for m in mains])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_compiled_adamw_reads_bf16_gradients_exactly():
    """DDP's aliased bf16 gradients: the compiled one-pass AdamW given the bf16 gradient updates
    exactly as when it is given the same gradient widened to fp32."""
    from megatron.core.optimizer.fused_adamw import adamw_step

    results = []
    for widen in (False, True):
        g = torch.Generator().manual_seed(0)
        mains = [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in [(300, 70), (70,)]]
        models = [m.detach().to(torch.bfloat16) for m in mains]
        opt = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1, fused=True)
        for _ in range(3):
            grads = [torch.randn(m.shape, generator=g).cuda().bfloat16() for m in mains]
            grads = [x.float() if widen else x for x in grads]
            adamw_step(
                opt,
                {id(m): p for m, p in zip(mains, models)},
                torch.tensor(2.0, device="cuda"),
                grads={id(m): x for m, x in zip(mains, grads)},
            )
        results.append([m.detach().clone() for m in mains])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_compiled_adamw_skip_keeps_every_bit_and_a_kept_step_is_unchanged():
    """A rejected step (skip flag on the device) in the compiled one-pass AdamW: params, moments, step
    count and the bf16 model copy keep their bits even with NaN gradients; a kept step (flag 0)
    updates exactly as a step given no flag."""
    from megatron.core.optimizer.fused_adamw import adamw_step

    def make():
        g = torch.Generator().manual_seed(0)
        mains = [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in [(300, 70), (70,)]]
        opt = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1, fused=True)
        return mains, [m.detach().to(torch.bfloat16) for m in mains], opt

    (a, am, aopt), (b, bm, bopt) = make(), make()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(m.shape, generator=g).cuda() for m in a]
        for mains, models, opt, skip in (
            (a, am, aopt, torch.zeros((), dtype=torch.bool, device="cuda")),
            (b, bm, bopt, None),
        ):
            adamw_step(
                opt,
                {id(m): p for m, p in zip(mains, models)},
                torch.tensor(2.0, device="cuda"),
                grads={id(m): x for m, x in zip(mains, grads)},
                skip=skip,
            )
    for x, y in zip(a + am, b + bm):
        assert torch.equal(x, y)
    before = [t.clone() for t in a + am] + [t.clone() for st in aopt.state.values() for t in st.values()]
    nan = [torch.full_like(m, float("nan")) for m in a]
    adamw_step(
        aopt,
        {id(m): p for m, p in zip(a, am)},
        torch.tensor(float("nan"), device="cuda"),
        grads={id(m): x for m, x in zip(a, nan)},
        skip=torch.ones((), dtype=torch.bool, device="cuda"),
    )
    after = list(a + am) + [t for st in aopt.state.values() for t in st.values()]
    for x, y in zip(before, after):
        assert torch.equal(x, y)


def test_compiled_gradient_scaling_matches_eager():
    """fp32 multiply, one rounding, on both paths. (A first version computed ``grad * scale`` eagerly,
    which for a bf16 ``grad`` rounds the 0-dim fp32 scale to bf16 first; Inductor does not, and this
    test failed on the H200 before ``_scaled`` widened explicitly. Not yet re-run on a GPU.)"""
    from megatron.core.fusions.linear_cross_entropy import _scaled, _scaled_fn

    scale = torch.tensor(0.3716, device="cuda")
    for x, dtype in (
        (torch.randn(4096, 1024, device="cuda").bfloat16(), torch.bfloat16),
        (torch.randn(1000, 300, device="cuda"), torch.bfloat16),
    ):
        assert torch.equal(_scaled_fn(x, scale, dtype, compile=True), _scaled(x, scale, dtype))


# Measured on an H200 (2026-11-30): compiled e4m3 quantisation (amax -> scale -> scaled cast) does not
# give eager ATen's values bit for bit (e5m2 does). The two tests below locate it: given the same
# scale the compiled cast equals ATen's, and the compiled scale is within 2 ulp of the eager one
# (both passed), so a scale one ulp apart moves a few values across an e4m3 rounding boundary; no
# bias. strict: once it passes, the marker must go.
E4M3_CAST_DEFECT = pytest.mark.xfail(
    strict=True, reason="compiled float8_e4m3fn quantisation differs from eager"
)


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float8_e4m3fn, marks=E4M3_CAST_DEFECT), torch.float8_e5m2]
)
def test_compiled_fp8_quantisation_rounds_like_eager(dtype):
    """Inside compiled layers the FP8 casts are generated by Inductor; they must round as ATen's do
    (a truncating cast would bias every FP8 GEMM, the suspected cause of FP8's worse early loss)."""
    from megatron.core.fusions.fp8 import quantize, scale_from_amax

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    torch.manual_seed(3)
    t = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 3

    def q(x):
        return quantize(x, scale_from_amax(x.abs().amax(), dtype), dtype)

    eager, compiled = q(t), torch.compile(q)(t)
    mismatched = (eager.float() != compiled.float()).float().mean().item()
    assert mismatched == 0.0, f"{100 * mismatched:.3f}% of the compiled FP8 casts differ from eager"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_fp8_cast_with_a_given_scale_rounds_like_eager(dtype):
    """Separates the two suspects of the test above: with the scale computed eagerly, the compiled
    multiply-saturate-cast must give ATen's values exactly (a cast that rounds differently would bias
    every FP8 GEMM)."""
    from megatron.core.fusions.fp8 import quantize, scale_from_amax

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    torch.manual_seed(3)
    t = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 3
    scale = scale_from_amax(t.abs().amax(), dtype)
    eager, compiled = quantize(t, scale, dtype), torch.compile(quantize)(t, scale, dtype)
    assert torch.equal(eager.float(), compiled.float())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_fp8_scale_is_within_two_ulp_of_eager(dtype):
    """The other suspect: Triton's fp32 division is not correctly rounded. A scale one or two ulp off
    moves a few values across a rounding boundary, which is harmless; more would not be."""
    from megatron.core.fusions.fp8 import scale_from_amax

    amax = torch.rand(1000, device="cuda") * 100 + 1e-3
    eager, compiled = scale_from_amax(amax, dtype), torch.compile(scale_from_amax)(amax, dtype)
    assert ((compiled - eager).abs() <= 2 * torch.finfo(torch.float32).eps * eager.abs()).all()


def test_compiled_delayed_fp8_gemm_matches_eager_and_records_its_history():
    """Delayed scaling inside torch.compile (fullgraph) with torch._scaled_mm: three steps agree with
    eager code (up to the 1-ulp scale difference of compiled quantisation) and fill the same history."""
    from megatron.core.fusions.fp8 import Fp8Gemm, Fp8Recipe

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    torch.manual_seed(5)
    recipe = Fp8Recipe("hybrid", "delayed", 16, "max")
    eager, compiled = (Fp8Gemm(recipe, device="cuda", kernels=cuda_kernels()) for _ in range(2))
    fn = torch.compile(lambda x, w: compiled(x, w, None), fullgraph=True)
    x0 = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16) * 1e-4
    for step in range(3):
        results = []
        for f in (lambda x, w: eager(x, w, None), fn):
            x, w = (x0 * (step + 1)).requires_grad_(), w0.clone().requires_grad_()
            y = f(x, w)
            y.backward(dy)
            results.append((y, x.grad, w.grad))
        for a, b in zip(*results):
            assert rel(b, a) < 1e-2
    torch.testing.assert_close(compiled.amax_history, eager.amax_history, rtol=1e-6, atol=0)
    assert compiled.initialized.all() and compiled.amax_history[:, :3].gt(0).all()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_evaluation_forward_matches_the_training_forward(recipe):
    """Under no_grad the FP8 linear casts with torch ops (no transposed copies): eagerly it equals the
    training forward (Triton cast-transposes) bit for bit; compiled, within the compiled scale's ulp."""
    from megatron.core.fusions.fp8 import Fp8Gemm, Fp8Recipe

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    torch.manual_seed(6)
    gemm = Fp8Gemm(Fp8Recipe("hybrid", recipe, 16, "max"), device="cuda", kernels=cuda_kernels())
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(lambda a, b: gemm(a, b, None), fullgraph=True)
    for _ in range(2):  # delayed: cold, then warm history
        with torch.no_grad():
            evaluated, evaluated_compiled = gemm(x, w, None), compiled(x, w)
        trained = gemm(x.clone().requires_grad_(), w.clone().requires_grad_(), None)
        trained.float().sum().backward()
        assert torch.equal(evaluated, trained.detach())
        assert rel(evaluated_compiled, evaluated) < 1e-2


def test_compiled_fp8_matmul_gradients_match_eager():
    from megatron.core.fusions.fp8 import Fp8Recipe, fp8_matmul

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    torch.manual_seed(4)
    recipe = Fp8Recipe("hybrid", "tensorwise")
    x0 = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16) * 1e-4
    results = []
    for fn in (fp8_matmul, torch.compile(fp8_matmul)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, recipe, use_triton=cuda_kernels().uses("fp8_cast"))
        y.backward(dy)
        results.append((y, x.grad, w.grad))
    ref_y = x0.float() @ w0.float().t()
    assert rel(results[0][0], ref_y) < 0.06
    for a, b in zip(*results):
        assert rel(b, a) < 1e-2


def test_triton_swiglu_backward_matches_torch_and_runs_inside_compiled_code():
    import torch.nn.functional as F

    from megatron.core.fusions import triton_kernels as tk

    torch.manual_seed(0)
    x = (torch.randn(4096, 2, 2 * 2048, device="cuda") * 3).bfloat16()
    g = torch.randn(4096, 2, 2048, device="cuda").bfloat16()
    got = tk.swiglu_backward_triton(g, x)
    torch.testing.assert_close(got.float(), tk.swiglu_backward_torch(g, x).float(), rtol=1e-2, atol=1e-2)
    assert self_check(torch.device("cuda"))["swiglu"] is None

    def layer(inp):
        return tk.SwiGLU.apply(inp) * 2.0

    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):  # fullgraph: no silent graph break
        xi = x.detach().clone().requires_grad_()
        fn(xi).float().sum().backward()
        results.append(xi.grad)
    torch.testing.assert_close(results[0].float(), results[1].float(), rtol=1e-2, atol=1e-2)
    xr = x.float().detach().requires_grad_()
    gate, up = xr.chunk(2, dim=-1)
    (F.silu(gate) * up * 2.0).sum().backward()
    torch.testing.assert_close(results[1].float(), xr.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(8192, 128256), (16384, 50304), (300, 1000)])
def test_triton_cross_entropy_pass_matches_compiled_step(shape):
    from megatron.core.fusions import triton_kernels as tk
    from megatron.core.fusions.linear_cross_entropy import _loss_and_dlogits_

    c, v = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(c, v, device="cuda", generator=g) * 4).bfloat16()
    target = torch.randint(0, v, (c,), device="cuda", generator=g)
    weights = (torch.rand(c, device="cuda", generator=g) > 0.1).float()
    ref = logits.clone()
    ref_loss = _loss_and_dlogits_(ref, target, weights)
    got = logits.clone()
    loss = tk.cross_entropy_grad_triton(got, target, weights)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_fp8_cast_transpose_and_amax_equal_the_torch_code(dtype):
    """The FP8 gradient kernels bit for bit against the torch code, on fc1's gradient shape of
    llama-3b and an odd one, and as opaque ops inside a fullgraph compile."""
    from megatron.core.fusions.triton import fp8_cast as tk

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n in ((8192, 16384), (1000, 333)):
        t = (torch.randn(m, n, device="cuda", generator=g) * 3).bfloat16()
        t[7, 5] = 1e4  # saturates
        scale = torch.finfo(dtype).max / t.float().abs().amax() * 4
        for with_amax in (True, False):
            got = tk.fp8_cast_transpose_triton(t, scale, dtype, with_amax)
            ref = tk.fp8_cast_transpose_torch(t, scale, dtype, with_amax)
            assert len(got) == len(ref) == (3 if with_amax else 2)
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
        assert torch.equal(tk.fp8_amax_triton(t), tk.fp8_amax_torch(t))

    def f(t, s):
        q, q_t, amax = tk.fp8_cast_transpose_amax(
            t * 2, s, dtype, True
        )  # the multiply: a graph around the op
        q2, q2_t = tk.fp8_cast_transpose(t, s, dtype, True)
        return q, q_t, q2, q2_t, tk.fp8_amax(t, True) + amax

    compiled = torch.compile(f, fullgraph=True)(t, scale)
    eager = f(t, scale)
    for a, b in zip(compiled, eager):
        assert torch.equal(a.float(), b.float())
    assert self_check(torch.device("cuda"))["fp8_cast"] is None


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_training_with_evaluation_through_pretrain_gpt(tmp_path, recipe):
    """A small FP8 run of pretrain_gpt.py with compiled layers that evaluates between steps (the
    no-grad FP8 forward inside the compiled layers), accumulates two micro-batches a step and saves a
    checkpoint: it finishes with finite training and validation losses."""
    import json
    import os
    import subprocess
    import sys

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    metrics = tmp_path / "metrics.jsonl"
    args = (
        "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
        "--vocab-size 512 --bf16 --train-iters 6 --eval-interval 3 --eval-iters 2 --log-interval 1 "
        f"--fp8-format hybrid --fp8-recipe {recipe} --save {tmp_path / 'ckpt'} --save-interval 6 "
        f"--metrics-file {metrics}"
    ).split()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            os.path.join(root, "pretrain_gpt.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert "validation loss at iteration 3" in res.stdout and "validation loss at iteration 6" in res.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r["lm loss"] for r in records if "lm loss" in r]
    val = [r["lm loss validation"] for r in records if "lm loss validation" in r]
    assert len(train) == 6 and len(val) == 2 and torch.isfinite(torch.tensor(train + val)).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_swiglu_fp8_kernels_equal_the_two_passes(dtype):
    """The FP8 SwiGLU MLP's fused kernels on llama-3b's shapes and an odd one: the backward one bit for
    bit against the Triton SwiGLU backward followed by the cast-transpose (same formulas); the forward
    one against SwiGLU's torch code (eager and as Inductor compiles it) followed by the cast, fp8 codes
    equal but for rare neighbours (sigmoid's last fp32 bit); inside a fullgraph compile likewise."""
    from megatron.core.fusions.triton import swiglu_fp8 as tk
    from megatron.core.fusions.triton.fp8_cast import fp8_cast_transpose_triton
    from megatron.core.fusions.triton.swiglu import swiglu_backward_triton, swiglu_fp32

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    assert cuda_kernels().uses("swiglu_fp8")  # its self-check passes on this GPU
    g = torch.Generator(device="cuda").manual_seed(0)
    compiled_swiglu = torch.compile(swiglu_fp32, fullgraph=True)
    for m, f in ((8192, 8192), (1000, 333)):
        x = (torch.randn(m, 2 * f, device="cuda", generator=g) * 3).bfloat16()
        grad = torch.randn(m, f, device="cuda", generator=g).bfloat16()
        x[7, 5] = 200.0  # saturates
        dh = swiglu_backward_triton(grad, x)
        scale = torch.finfo(dtype).max / dh.float().abs().amax() * 4
        got = tk.swiglu_backward_cast_transpose_amax_triton(grad, x, scale, dtype)
        ref = fp8_cast_transpose_triton(dh, scale, dtype, True)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
        for a_ref in (swiglu_fp32(x), compiled_swiglu(x)):
            scale = torch.finfo(dtype).max / a_ref.float().abs().amax() * 4
            got = tk.swiglu_cast_transpose_amax_triton(x, scale, dtype)
            ref = fp8_cast_transpose_triton(a_ref, scale, dtype, True)
            assert not tk.fp8_codes_differ(got[0], ref[0]) and torch.equal(got[1].float(), got[0].float().t())
            torch.testing.assert_close(got[2], ref[2], rtol=1e-2, atol=0)

    def both(x, grad, s):
        return (
            tk.swiglu_cast_transpose_amax(x * 1, s, dtype, True),
            tk.swiglu_backward_cast_transpose_amax(grad, x, s, dtype, True),
        )

    # Inside a compile, Inductor launches the same kernels: bit for bit. (The torch code, which a
    # compile fuses without SwiGLU's bf16 rounding, gives other e4m3 codes: the plan picks one or the
    # other for the whole run.)
    for a, b in zip(torch.compile(both, fullgraph=True)(x, grad, scale), both(x, grad, scale)):
        for u, v in zip(a, b):
            assert u.dtype == v.dtype and torch.equal(u.float(), v.float())


def test_swiglu_mlp_block_trains_like_the_two_linears_on_the_gpu():
    """A small GPT with delayed FP8, compiled by Inductor: the SwiGLU MLP as one FP8 block (fused
    kernels, torch._scaled_mm) against the two FP8 linears with SwiGLU between them, four steps: the
    same losses to 1e-3, weight gradients to 2%, amax histories to 1% (rare fp8 codes of SwiGLU's
    output may differ by one step, see above)."""
    import dataclasses

    from megatron.core.execution_plan import resolve
    from megatron.core.fusions.compile import compile_layers
    from megatron.core.fusions.fp8 import Fp8Gemm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_plan_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 needs compute capability 9.0")
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        activation="swiglu",
        ffn_hidden_size=512,
        position_embedding_type="rope",
        add_bias_linear=False,
        bf16=True,
        fp8_format="hybrid",
        fp8_recipe="delayed",
        fp8_amax_history_len=16,
    )
    results = []
    plan = resolve(cfg, torch.device("cuda"))  # the self-checks run on this GPU
    assert plan.fp8 is not None and plan.fp8.swiglu_block
    for fused in (True, False):
        p = (
            plan
            if fused
            else dataclasses.replace(plan, fp8=dataclasses.replace(plan.fp8, swiglu_block=False))
        )
        model = GPTModel(
            cfg,
            get_gpt_decoder_block_plan_spec(p),
            vocab_size=512,
            max_sequence_length=128,
            seed=1,
            execution_plan=p,
        ).cuda()
        assert all(
            (getattr(layer.mlp, "fp8_swiglu", None) is not None) == fused for layer in model.decoder.layers
        )
        compile_layers([model], TransformerLayer)
        losses = []
        for step in range(4):
            ids = torch.randint(
                0, 512, (2, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(step)
            )
            for p in model.parameters():
                p.grad = None
            loss = model(ids, None, None, labels=ids).float().mean()
            loss.backward()
            losses.append(loss.item())
        results.append(
            (
                losses,
                [p.grad.clone() for p in model.parameters() if p.grad is not None],
                [m.amax_history.clone() for m in model.modules() if isinstance(m, Fp8Gemm)],
            )
        )
    (l0, g0, h0), (l1, g1, h1) = results
    assert l0 == pytest.approx(l1, rel=1e-3)
    assert len(g0) == len(g1) and all(rel(a, b) < 2e-2 for a, b in zip(g0, g1))
    assert all(torch.allclose(a, b, rtol=1e-2, atol=0) for a, b in zip(h0, h1))
    assert all(h[:, :4].gt(0).all() for h in h0)
