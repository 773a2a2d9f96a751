"""Param groups, fp32 main params, gradient clipping and grad statistics."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, param_is_not_duplicate


def test_param_groups_exclude_bias_and_1d(tools):
    model = tools["TinyMLP"]()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.2), [model, model])
    decay, no_decay = opt.param_groups
    assert (decay["name"], decay["wd_mult"], decay["lr_mult"], decay["weight_decay"]) == (
        "decay",
        1.0,
        1.0,
        0.2,
    )
    assert (no_decay["wd_mult"], no_decay["lr_mult"], no_decay["weight_decay"]) == (0.0, 1.0, 0.0)
    assert [tuple(p.shape) for p in decay["params"]] == [(16, 8), (4, 16)]
    assert (
        len(no_decay["params"]) == 4
    )  # fc1.bias, norm.weight, norm.bias, fc2.bias; shared chunk listed once
    assert isinstance(opt.optimizer, torch.optim.AdamW) and opt.optimizer.defaults["foreach"]
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.8), [model])
    assert isinstance(sgd.optimizer, torch.optim.SGD) and sgd.optimizer.defaults["momentum"] == 0.8


@pytest.mark.parametrize("use_main_grad", [False, True])
def test_bf16_with_fp32_main_params_tracks_fp32(tools, use_main_grad):
    model = tools["TinyMLP"](torch.bfloat16)
    ref = tools["TinyMLP"]()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = tools["make"](model, lr=1e-2, bf16=True)
    ref_opt = tools["make"](ref, lr=1e-2)
    assert all(m.dtype == torch.float32 for m in opt.main_params)
    res = tools["train_steps"](model, opt, range(20), use_main_grad=use_main_grad)
    ref_res = tools["train_steps"](ref, ref_opt, range(20))
    assert all(ok for ok, _, _ in res)
    for (_, n, _), (_, rn, _) in zip(res, ref_res):
        assert n == pytest.approx(rn, rel=0.05)
    for p, m, r in zip(opt.model_params, opt.main_params, ref_opt.main_params):
        assert torch.equal(p, m.to(torch.bfloat16))  # model params are the rounded main params
        torch.testing.assert_close(m, r, atol=2e-2, rtol=0.0)
        assert not torch.equal(m, m.to(torch.bfloat16).float())  # main params keep fp32 precision
    if use_main_grad:
        assert all(float(p.main_grad.abs().sum()) == 0.0 for p in model.parameters())  # zero_grad


def test_fp32_params_are_updated_in_place_from_main_grad():
    model = torch.nn.Linear(3, 2)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0), [model]
    )
    assert all(m is p for m, p in zip(opt.main_params, model.parameters()))
    before = model.weight.detach().clone()
    model.weight.main_grad = torch.ones(2, 3)
    model.bias.main_grad = None  # falls back to .grad
    model.bias.grad = torch.full((2,), 2.0)
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx((6 * 1.0 + 2 * 4.0) ** 0.5)
    torch.testing.assert_close(model.weight.detach(), before - 0.5)


def grads_for(model: torch.nn.Module, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(p.shape, generator=g) * scale for p in model.parameters()]


@pytest.mark.parametrize("clip_grad,scale", [(1.0, 10.0), (1.0, 1e-3), (0.5, 3.0)])
def test_clipping_matches_torch(tools, clip_grad, scale):
    model = tools["TinyMLP"]()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=clip_grad), [model])
    grads = grads_for(model, scale)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, clip_grad)
    ok, norm, num_zeros = opt.step()
    assert ok and num_zeros is None
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad)


def test_clip_grad_zero_reports_norm_without_clipping(tools):
    model = tools["TinyMLP"]()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0), [model])
    grads = grads_for(model, 100.0)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    _, norm, _ = opt.step()
    assert norm == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))), rel=1e-6
    )
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_duplicates_excluded_from_norm_and_zero_count():
    shared = torch.nn.Parameter(torch.ones(4))
    shared.shared_embedding_copy = True
    replicated = torch.nn.Parameter(torch.ones(3))
    tp = torch.nn.Parameter(torch.ones(2))
    tp.tensor_model_parallel = True
    assert not param_is_not_duplicate(shared, 0)
    assert param_is_not_duplicate(replicated, 0) and not param_is_not_duplicate(replicated, 1)
    assert param_is_not_duplicate(tp, 0) and param_is_not_duplicate(tp, 1)

    model = torch.nn.ParameterList([shared, replicated, tp])
    cfg = OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, log_num_zeros_in_grad=True)
    # tp rank 0 counts replicated and tp grads; rank 1 only the tp grad; the shared copy never.
    for tp_rank, expected_sq, expected_zeros in [(0, 9.0 + 16.0, 3), (1, 16.0, 1)]:
        shared.grad = torch.full((4,), 5.0)
        replicated.grad = torch.tensor([3.0, 0.0, 0.0])
        tp.grad = torch.tensor([4.0, 0.0])
        opt = get_megatron_optimizer(cfg, [model], tp_rank=tp_rank)
        ok, norm, zeros = opt.step()
        assert ok and norm == pytest.approx(expected_sq**0.5) and zeros == expected_zeros


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("scale", [10.0, 1e-3])
def test_fused_kernels_fold_clipping_into_the_gradient_read(tools, name, scale):
    """With fused kernels (CUDA default; forced here on the CPU) clipping is the kernels' grad_scale:
    the update equals clip-then-step with the multi-tensor kernels, and no pass rewrites the grads."""
    results = []
    for fused in (False, True):
        model = tools["TinyMLP"]()
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer=name, lr=0.1, clip_grad=1.0, sgd_momentum=0.9), [model]
        )
        for group in opt.optimizer.param_groups:
            group["fused"], group["foreach"] = fused, not fused
        for step in range(3):
            for p, g in zip(model.parameters(), grads_for(model, scale * (step + 1))):
                p.grad = g
            ok, norm, _ = opt.step()
        assert ok and not hasattr(opt.optimizer, "grad_scale")
        results.append(([p.detach().clone() for p in model.parameters()], norm))
    (plain, norm_plain), (fused_params, norm_fused) = results
    assert norm_plain == pytest.approx(norm_fused, rel=1e-6)
    for a, b in zip(plain, fused_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
