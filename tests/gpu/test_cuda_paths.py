"""CUDA-only paths (compiled helpers, mixed-dtype GEMMs), run on the GPU machine:

    python -m pytest tests/gpu -q

The CPU suite skips this file (it needs a CUDA device); the same arithmetic runs eagerly on the
CPU in tests/unit/test_fusions.py and tests/distributed/test_ddp.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import distributed_data_parallel as ddp_mod
from megatron.core.fusions.linear_cross_entropy import _accumulate_wgrad, linear_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def test_addmm_accumulates_in_fp32_in_place():
    torch.manual_seed(0)
    acc = torch.randn(64, 32, device="cuda")
    a, b = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16), torch.randn(48, 32, device="cuda",
                                                                                 dtype=torch.bfloat16)
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
    loss = linear_cross_entropy(h, w, t, chunk, loss_weights=mask)
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
    ddp_mod._accumulate(view, grad)
    assert torch.equal(acc[:100], before[:100]) and torch.equal(acc[900:], before[900:])
    torch.testing.assert_close(acc[100:900], before[100:900] + grad.float())
    grad2 = torch.randn(37, device="cuda").bfloat16()  # another length: same graph (dynamic)
    acc2 = torch.zeros(37, device="cuda")
    ddp_mod._accumulate(acc2, grad2)
    torch.testing.assert_close(acc2, grad2.float())


def test_compiled_one_pass_adamw_matches_eager_cpu():
    from megatron.core.optimizer.fused_adamw import adamw_step

    results = []
    for dev in ("cpu", "cuda"):
        g = torch.Generator().manual_seed(0)
        mains = [torch.nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in [(300, 70), (70,), (5, 3, 2)]]
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
