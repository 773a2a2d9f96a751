"""The hand-written Triton kernels against the torch code they replace, on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are defined, so each check runs
in a fresh process). Needs the ``triton`` package, which CPU builds of torch do not bring; CI
installs it (.ci/run). On GPUs tests/gpu runs the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

pytestmark = pytest.mark.skipif(
    not HAVE_TRITON, reason="the triton package is not installed (CI installs it)"
)


def _run(code: str) -> str:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_swiglu_backward_kernel_matches_autograd():
    out = _run("""
        import torch
        import torch.nn.functional as F
        from megatron.core.fusions import swiglu as sw
        from megatron.core.fusions.triton import swiglu as tk

        torch.manual_seed(0)
        for shape, dtype in (((3, 2, 2 * 1100), torch.bfloat16), ((5, 2 * 64), torch.float32)):
            x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
            gate, up = x.float().chunk(2, dim=-1)
            y = F.silu(gate) * up
            g = torch.randn(y.shape).to(dtype)
            (ref,) = torch.autograd.grad(y, x, g.float())
            got = tk.swiglu_backward_triton(g, x.detach())
            assert got.dtype == dtype and got.shape == x.shape
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
            # the op (Triton under the interpreter) and the torch code agree too
            torch.testing.assert_close(tk.swiglu_backward(g, x.detach()).float(),
                                       tk.swiglu_backward_torch(g, x.detach()).float(), rtol=tol, atol=tol)
        # rows of x that are not contiguous (a slice of a wider buffer)
        wide = torch.randn(7, 2 * 50 + 10)
        x = wide[:, :100]
        g = torch.randn(7, 50)
        torch.testing.assert_close(tk.swiglu_backward_triton(g, x), tk.swiglu_backward_torch(g, x),
                                   rtol=1e-5, atol=1e-5)
        # through the autograd Function
        x = torch.randn(4, 2 * 96, requires_grad=True)
        sw.swiglu_triton(x).sum().backward()
        x2 = x.detach().clone().requires_grad_()
        gate, up = x2.chunk(2, dim=-1)
        (F.silu(gate) * up).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
        # the one-time self-check a GPU run does before using the kernel
        assert tk.check_swiglu(torch.device("cpu")) == ""
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_cross_entropy_kernel_matches_the_compiled_step():
    out = _run("""
        import torch
        from megatron.core.fusions.triton import cross_entropy as tk
        from megatron.core.fusions.linear_cross_entropy import _loss_and_dlogits, _loss_and_dlogits_

        torch.manual_seed(0)
        # a vocabulary that is not a multiple of the block, one within a block, and bf16/fp32 logits
        for c, v, dtype in ((6, 9000, torch.bfloat16), (4, 300, torch.float32), (3, 4096, torch.bfloat16)):
            logits = (torch.randn(c, v) * 4).to(dtype)
            logits[0, :10] = 40.0  # large logits: the online maximum must rescale the running sum
            target = torch.randint(0, v, (c,))
            target[0] = 3
            weights = torch.tensor([1.0, 0.0] + [0.5] * (c - 2))
            ref = logits.clone()
            ref_loss = _loss_and_dlogits_(ref, target, weights)
            got = logits.clone()
            loss = tk.cross_entropy_grad_triton(got, target, weights)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
            assert torch.equal(got[1], torch.zeros_like(got[1]))  # weight 0: no gradient
            # the fused cross entropy's step takes the kernel when asked (interpreter), the torch code otherwise
            again, torch_path = logits.clone(), logits.clone()
            torch.testing.assert_close(_loss_and_dlogits(again, target, weights, True, False), ref_loss,
                                       rtol=1e-5, atol=1e-5)
            assert torch.equal(again, got)
            assert torch.equal(_loss_and_dlogits(torch_path, target, weights, False, False), ref_loss)
        assert tk.check_cross_entropy(torch.device("cpu")) == ""
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_fp8_cast_transpose_and_amax_kernels_match_the_torch_code():
    """Tiling, masking, transposition, saturation and the amax of the FP8 gradient kernels. Triton's
    interpreter rounds fp32 -> fp8 wrongly (a mantissa carry does not reach the exponent), so here the
    kernel stores fp32 with e4m3's range; the fp8 rounding itself is checked bit for bit on a GPU
    (tests/gpu and the kernels' one-time self-check)."""
    out = _run("""
        import torch
        from megatron.core.fusions.triton import fp8_cast as tk

        torch.manual_seed(0)
        for m, n in ((200, 300), (64, 128), (1, 7), (130, 65)):  # multiples of the tile, and not
            t = (torch.randn(m, n) * 5).bfloat16()
            t[0, 0] = 1000.0  # saturates at 448
            t[-1, -1] = -2000.0
            scale = torch.tensor(2.5)
            ref = (t.float() * scale).clamp(-448.0, 448.0)
            for with_amax in (True, False):
                grid = (-(-m // 64), -(-n // 128))
                out, out_t = torch.full((m, n), -1.0), torch.full((n, m), -1.0)
                partials = torch.zeros(grid[0] * grid[1])  # one slot per tile
                tk.cast_transpose_kernel[grid](t, scale.reshape(1), out, out_t, partials, m, n, t.stride(0),
                                                FMAX=448.0, AMAX=with_amax, BM=64, BN=128)
                assert torch.equal(out, ref) and torch.equal(out_t, ref.t())
                if with_amax:  # each tile's own max in its slot
                    tiles = [t[i:i + 64, j:j + 128].float().abs().max() for i in range(0, m, 64) for j in range(0, n, 128)]
                    assert torch.equal(partials, torch.stack(tiles))
                else:
                    assert not partials.any()
        # rows that are a slice of a wider buffer (row stride != n)
        wide = torch.randn(70, 150).bfloat16()
        t = wide[:, :100]
        out, out_t, partials = torch.empty(70, 100), torch.empty(100, 70), torch.zeros(2)
        tk.cast_transpose_kernel[(2, 1)](t, torch.ones(1), out, out_t, partials, 70, 100, t.stride(0),
                                          FMAX=448.0, AMAX=True, BM=64, BN=128)
        assert torch.equal(out, t.float().clamp(-448, 448)) and torch.equal(out_t, out.t())
        assert partials.max() == t.float().abs().max()
        # the op's wrapper: the amax over the tiles, NaN reported as inf
        t = torch.randn(130, 300).bfloat16()
        t[100, 200] = -77.0
        assert tk.fp8_cast_transpose_triton(t, torch.tensor(1.0), torch.float32, True)[2].item() == 77.0
        assert len(tk.fp8_cast_transpose_triton(t, torch.tensor(1.0), torch.float32, False)) == 2
        t[3, 3] = float("nan")
        assert tk.fp8_cast_transpose_triton(t, torch.tensor(1.0), torch.float32, True)[2].item() == float("inf")
        # the amax kernel: several programs striding over blocks, a tail, NaN reported as inf
        for numel in (1, 4095, 4096 * 9 + 17):
            x = torch.randn(numel) * 3
            x[numel // 2] = -50.0
            assert tk.fp8_amax_triton(x).item() == 50.0 == tk.fp8_amax_torch(x).item()
            assert tk.fp8_amax_triton(x.bfloat16().view(1, -1)).item() == 50.0
        x[5] = float("nan")
        assert tk.fp8_amax_triton(x).item() == float("inf") == tk.fp8_amax_torch(x).item()
        # the op's fp8 outputs: shapes, dtypes, the transpose and the amax (values: see the docstring)
        t = (torch.randn(96, 48) * 3).bfloat16()
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            s = torch.tensor(10.0)
            q, q_t, amax = tk.fp8_cast_transpose_amax(t, s, dtype, True)
            rq, rq_t, ramax = tk.fp8_cast_transpose_torch(t, s, dtype, True)
            assert q.dtype == dtype and q.shape == (96, 48) and q_t.shape == (48, 96)
            assert torch.equal(q_t.float(), q.float().t()) and torch.equal(amax, ramax)
            assert rq.dtype == dtype and torch.equal(rq_t.float(), rq.float().t())
            q2, q2_t = tk.fp8_cast_transpose(t, s, dtype, True)
            assert torch.equal(q2.float(), q.float()) and torch.equal(q2_t.float(), q_t.float())
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_fused_swiglu_cast_transpose_kernels_match_the_two_passes():
    """The FP8 SwiGLU MLP's two fused kernels (activation + cast-transpose, activation gradient +
    cast-transpose) against SwiGLU's torch code followed by the cast: each half in its columns of both
    layouts, masking at ragged edges and strided rows, the value rounded to bf16 before it is scaled,
    saturation and the per-tile amaxes (fp32 stores: see the test above; the fp8 codes are compared on
    a GPU and in the kernels' self-check)."""
    out = _run("""
        import torch
        from megatron.core.fusions.triton import swiglu_fp8 as tk
        from megatron.core.fusions.triton.swiglu import swiglu_backward_torch, swiglu_fp32

        torch.manual_seed(0)
        for m, f in ((200, 300), (64, 128), (1, 7), (130, 65)):  # multiples of the tiles, and not
            x = (torch.randn(m, 2 * f) * 3).bfloat16()
            g = torch.randn(m, f).bfloat16()
            g[0, 0] = 500.0  # saturates at 448 after scaling
            x[-1, 0] = 300.0
            scale = torch.tensor(2.5)
            for name, ref_t, bm, bn, launch in (
                    ("forward", swiglu_fp32(x), 64, 128, lambda q, q_t, p, grid: tk.swiglu_cast_transpose_kernel[grid](
                        x, scale.reshape(1), q, q_t, p, m, f, x.stride(0), FMAX=448.0, BM=64, BN=128)),
                    ("backward", swiglu_backward_torch(g, x), 64, 64, lambda q, q_t, p, grid:
                        tk.swiglu_bwd_cast_transpose_kernel[grid](g, x, scale.reshape(1), q, q_t, p, m, f, g.stride(0),
                                                                   x.stride(0), FMAX=448.0, BM=64, BN=64))):
                n = ref_t.shape[1]
                ref = (ref_t.float() * scale).clamp(-448.0, 448.0)
                grid = (-(-m // bm), -(-f // bn))
                q, q_t, partials = torch.full((m, n), -1.0), torch.full((n, m), -1.0), torch.zeros(grid[0] * grid[1])
                launch(q, q_t, partials, grid)
                # (sigmoid may differ from torch's in its last fp32 bit, so a bf16 rounding may flip)
                torch.testing.assert_close(q, ref, rtol=1e-2, atol=1e-2, msg=name)
                assert torch.equal(q_t, q.t()), name
                v = q[q.abs() < 448.0] / scale  # below saturation: bf16 values (rounded before scaling) x scale
                assert torch.equal(v, v.bfloat16().float()), name
                a = ref_t.float().abs()
                halves = a.chunk(2, dim=-1) if name == "backward" else (a,)
                tiles = [torch.stack([h[i:i + bm, j:j + bn].max() for h in halves]).max()
                         for i in range(0, m, bm) for j in range(0, f, bn)]
                torch.testing.assert_close(partials, torch.stack(tiles), rtol=1e-2, atol=0, msg=name)
        # strided rows (slices of wider buffers) through the wrappers; amax over the tiles; NaN as inf
        wide_x, wide_g = (torch.randn(70, 2 * 50 + 6) * 3).bfloat16(), torch.randn(70, 58).bfloat16()
        x, g = wide_x[:, :100], wide_g[:, :50]
        one = torch.tensor(1.0)
        for got, ref in ((tk.swiglu_cast_transpose_amax_triton(x, one, torch.float32), swiglu_fp32(x)),
                         (tk.swiglu_backward_cast_transpose_amax_triton(g, x, one, torch.float32),
                          swiglu_backward_torch(g, x))):
            q, q_t, amax = got
            torch.testing.assert_close(q, ref.float(), rtol=1e-2, atol=1e-2)
            assert torch.equal(q_t, q.t()) and amax.item() == q.abs().max().item()
        g[3, 3] = float("nan")
        assert tk.swiglu_backward_cast_transpose_amax_triton(g, x, one, torch.float32)[2].item() == float("inf")
        x = x.clone()
        x[3, 3] = float("nan")
        assert tk.swiglu_cast_transpose_amax_triton(x, one, torch.float32)[2].item() == float("inf")
        # the ops: fp8 outputs of the right shapes and dtypes, the transpose, the amax of the two passes
        x, g = (torch.randn(96, 2 * 48) * 3).bfloat16(), torch.randn(96, 48).bfloat16()
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for (q, q_t, amax), ref in ((tk.swiglu_cast_transpose_amax(x, torch.tensor(10.0), dtype, True), swiglu_fp32(x)),
                                        (tk.swiglu_backward_cast_transpose_amax(g, x, torch.tensor(10.0), dtype, True),
                                         swiglu_backward_torch(g, x))):
                assert q.dtype == q_t.dtype == dtype and q.shape == ref.shape and q_t.shape == ref.t().shape
                assert torch.equal(q_t.float(), q.float().t())
                torch.testing.assert_close(amax, ref.float().abs().max(), rtol=1e-2, atol=0)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_dispatch_never_runs_the_self_check(monkeypatch):
    """The kernels' self-checks run only when :func:`self_check` is called (at start-up, by the
    execution plan): neither a dispatch nor a trace with fake tensors (torch.compile) runs one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.core.fusions import triton as kt
    from megatron.core.fusions.triton.fp8_cast import fp8_amax, fp8_cast_transpose

    calls = []
    monkeypatch.setattr(kt, "SELF_CHECKS", {k: (lambda d, k=k: calls.append(k) or "") for k in kt.KERNELS})
    e4m3 = torch.float8_e4m3fn
    with FakeTensorMode():
        fake = torch.empty(4, 4)
        fp8_cast_transpose(fake, torch.tensor(1.0), e4m3, False)
    fp8_cast_transpose(torch.ones(4, 4), torch.tensor(1.0), e4m3, False)
    fp8_amax(torch.ones(4, 4), False)
    assert calls == []
    assert kt.self_check(torch.device("cpu"), interpret=True) == dict.fromkeys(kt.KERNELS)
    assert calls == list(kt.KERNELS)


def test_self_check_and_the_fused_cross_entropy_under_the_interpreter():
    """The start-up self-check with the real checks (interpreter: CPU tensors): the SwiGLU and cross
    entropy kernels pass; the FP8 ones pass or report the interpreter's fp8 rounding (see above) as a
    disagreement, never an exception. The fused output layer + cross entropy told to use the kernel
    gives the torch code's losses and gradients."""
    out = _run("""
        import torch
        from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy
        from megatron.core.fusions.triton import KERNELS, passed, self_check

        results = self_check(torch.device("cpu"), interpret=True)
        assert list(results) == list(KERNELS)
        assert results["swiglu"] is None and results["cross_entropy"] is None, results
        for name in ("fp8_cast", "swiglu_fp8"):
            assert results[name] is None or results[name].startswith("disagrees with the torch code"), results
        assert passed(results, True).uses("cross_entropy")
        torch.manual_seed(0)
        h0, w0 = torch.randn(24, 16), torch.randn(300, 16)
        t, mask = torch.randint(0, 300, (24,)), (torch.rand(24) > 0.2).float()
        got = []
        for use_triton in (True, False):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            loss = linear_cross_entropy(h, w, t, chunk=10, loss_weights=mask, use_triton=use_triton)
            ((loss * mask).sum() / mask.sum()).backward()
            got.append((loss, h.grad, w.grad))
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_jit_kernels_carry_no_python_type_annotations():
    """Triton's compiler resolves a kernel's annotations as globals of the kernel and accepts only
    ``tl.constexpr``: an ``Any`` (for mypy) makes every kernel fail its self-check on a GPU, which the
    interpreter used on the CPU does not notice. Checked here from the source."""
    import ast
    import pathlib

    import megatron.core.fusions.triton as package

    found, bad = 0, []
    for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                continue
            found += 1
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for arg in args:
                if arg.annotation is not None and ast.unparse(arg.annotation) != "tl.constexpr":
                    bad.append(f"{path.name}:{node.name}({arg.arg}: {ast.unparse(arg.annotation)})")
            if node.returns is not None:
                bad.append(f"{path.name}:{node.name} -> {ast.unparse(node.returns)}")
    assert found >= 9, found  # swiglu (2), cross entropy (1), fp8 casts (4), FP8 SwiGLU (2)
    assert not bad, bad
