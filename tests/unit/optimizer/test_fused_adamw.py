"""The one-pass AdamW step against torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.fused_adamw import adamw_step


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float32).to(dtype))
        for shape in [(7, 5), (5,), (3, 4, 2)]
    ]


@pytest.mark.parametrize("divisor", [None, 3.0])
def test_matches_torch_adamw_over_steps(divisor):
    ours, ref = _params(), _params()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW([{"params": ours[:2]}, {"params": ours[2:], "weight_decay": 0.0}], **kwargs)
    ref_opt = torch.optim.AdamW(
        [{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.0}], foreach=False, **kwargs
    )
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        for group in (opt.param_groups, ref_opt.param_groups):
            group[0]["lr"] = 1e-2 * (step + 1)  # a schedule: a new value every step
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=g)
            a.grad = grad.clone()
            b.grad = grad / divisor if divisor else grad.clone()
        adamw_step(opt, {}, None if divisor is None else torch.tensor(divisor))
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                opt.state[a][key], ref_opt.state[b][key].to(opt.state[a][key]), rtol=1e-5, atol=1e-8
            )


def test_writes_the_rounded_main_param_into_the_model_copy():
    mains = _params()
    models = [m.detach().to(torch.bfloat16) for m in mains]
    opt = torch.optim.AdamW(mains, lr=0.1)
    for m in mains:
        m.grad = torch.ones_like(m)
    mains[1].grad = None  # no gradient: neither updated nor copied
    adamw_step(opt, {id(m): p for m, p in zip(mains, models)}, None)
    assert torch.equal(models[0], mains[0].detach().to(torch.bfloat16))
    assert not torch.equal(models[0], _params()[0].detach().to(torch.bfloat16))
    assert torch.equal(models[1], _params()[1].detach().to(torch.bfloat16)) and mains[1] not in opt.state


def test_megatron_optimizer_uses_it_and_matches_the_torch_kernels(tools):
    """bf16 model, fp32 main params, clipping active: the one-pass path equals torch's AdamW plus the
    separate clip and copy passes (use_fused_adam=False selects those)."""
    runs = []
    for one_pass in (True, False):
        model = tools["TinyMLP"](torch.bfloat16)
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=1e-2, clip_grad=0.5, use_fused_adam=one_pass, weight_decay=0.1), [model]
        )
        assert opt._one_pass_adamw is one_pass
        runs.append((model, tools["train_steps"](model, opt, range(6))))
    (m1, r1), (m2, r2) = runs
    for (_, n1, _), (_, n2, _) in zip(r1, r2):
        assert n1 == pytest.approx(n2, rel=1e-5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=float(b.detach().abs().max()) * 2**-7)
