"""Loss scaling: Megatron's dynamic scaler semantics and overflow handling in the optimizer."""

from __future__ import annotations

import pytest
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.training.user_errors import flag_message


def test_hysteresis_backoff_min_and_growth():
    s = DynamicGradScaler(initial_scale=1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512.0  # hysteresis exhausted: back off
    s.update(True)
    assert s.scale == 256.0  # every further overflow backs off ...
    s.update(True)
    assert s.scale == 256.0  # ... but never below min_scale
    s.update(False)
    s.update(False)
    s.update(True)  # resets the growth tracker
    for _ in range(2):
        s.update(False)
    assert s.scale == 256.0
    s.update(False)  # third consecutive clean step
    assert s.scale == 512.0
    s.update(True)  # growth refilled the hysteresis: no back-off yet
    assert s.scale == 512.0
    assert s.state_dict() == {"scale": 512.0, "growth_tracker": 0, "hysteresis_tracker": 1}


def test_state_dict_and_validation():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=2, hysteresis=1)
    s.update(True)
    t = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=2, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 4.0, "growth_tracker": 0, "hysteresis_tracker": 0}
    with pytest.raises(ConfigError, match="min_scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)
    with pytest.raises(ConfigError, match="hysteresis"):
        DynamicGradScaler(initial_scale=1.0, min_scale=1.0, hysteresis=0)
    c = ConstantGradScaler(16.0)
    c.update(True)
    assert c.scale == 16.0 and c.inv_scale == 1 / 16


def fp16_optimizer(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    cfg = OptimizerConfig(
        lr=0.1,
        fp16=True,
        initial_loss_scale=2.0**10,
        min_loss_scale=2.0**8,
        loss_scale_window=2,
        hysteresis=2,
        **kw,
    )
    return model, get_megatron_optimizer(cfg, [model])


def test_overflow_skips_step_and_leaves_params():
    model, opt = fp16_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    mains_before = [m.clone() for m in opt.main_params]
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    model.bias.grad = torch.ones_like(model.bias)
    assert opt.step() == (False, None, None)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for m, b in zip(opt.main_params, mains_before):
        assert torch.equal(m, b)
    assert len(opt.optimizer.state) == 0  # the inner optimizer never ran
    assert opt.get_loss_scale() == 2.0**10  # hysteresis 2: first overflow tolerated
    opt.zero_grad()
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    assert opt.step()[0] is False
    assert opt.get_loss_scale() == 2.0**9


def test_growth_after_window_and_unscaled_grads_match_fp32():
    model, opt = fp16_optimizer(clip_grad=0.0)
    ref = torch.nn.Linear(4, 3)
    with torch.no_grad():
        ref.weight.copy_(model.weight.float())
        ref.bias.copy_(model.bias.float())
    ref_opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0), [ref])
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) for p in ref.parameters()]
        scale = opt.get_loss_scale()
        for p, gr in zip(model.parameters(), grads):
            p.main_grad = gr * scale  # what backward of a scaled loss accumulates into DDP's buffer
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone()
        ok, norm, _ = opt.step()
        _, ref_norm, _ = ref_opt.step()
        assert ok and norm == ref_norm  # power-of-two unscaling is exact
        for m, r in zip(opt.main_params, ref.parameters()):
            assert torch.equal(m, r)
        opt.zero_grad()
        ref_opt.zero_grad()
    assert opt.get_loss_scale() == 2.0**11  # doubled after loss_scale_window=2 clean steps
    loss = torch.tensor(3.0)
    assert opt.scale_loss(loss).item() == 3.0 * 2.0**11


def test_bf16_has_no_scaler_and_constant_scale_is_honoured():
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, bf16=True), [model])
    assert opt.grad_scaler is None and opt.get_loss_scale() == 1.0
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, fp16=True, loss_scale=128.0), [model.half()])
    assert isinstance(opt.grad_scaler, ConstantGradScaler) and opt.get_loss_scale() == 128.0
    with pytest.raises(ConfigError, match="loss_scale"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1, loss_scale=128.0), [torch.nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="fp16"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1, fp16=True, bf16=True), [model])


def test_config_errors_name_the_parameters():
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=2.0, min_loss_scale=4.0)
    assert e.value.params == ("min_loss_scale", "initial_loss_scale")
    OptimizerConfig(lr=0.1, initial_loss_scale=2.0, min_loss_scale=4.0)  # no dynamic scaler: not checked
    with pytest.raises(ConfigError) as e:
        get_megatron_optimizer(OptimizerConfig(lr=0.1, fp16=True, bf16=True), [torch.nn.Linear(2, 2)])
    assert e.value.params == ("fp16", "bf16")
    assert flag_message(e.value) == "--fp16 and --bf16 are mutually exclusive; set at most one"
    with pytest.raises(ConfigError) as e:
        get_megatron_optimizer(OptimizerConfig(lr=0.1), [torch.nn.Linear(2, 2).requires_grad_(False)])
    assert e.value.params == ("model_chunks",)
