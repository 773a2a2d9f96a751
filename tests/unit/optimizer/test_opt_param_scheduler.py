"""LR and WD schedules against values worked out by hand from Megatron's formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.core.config_utils import ConfigError
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# init_lr 0, max_lr 1.0, min_lr 0.1, warm-up 10 samples, decay 110 samples, WSD tail 20 samples.
BASE = dict(
    init_lr=0.0,
    max_lr=1.0,
    min_lr=0.1,
    lr_warmup_steps=10,
    lr_decay_steps=110,
    start_wd=0.05,
    end_wd=0.05,
    wd_incr_steps=100,
    wd_incr_style="constant",
)


def make(**overrides) -> OptimizerParamScheduler:
    opt = SimpleNamespace(param_groups=[{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0}])
    return OptimizerParamScheduler(opt, **{**BASE, **overrides})


def lr_at(sched: OptimizerParamScheduler, step: int) -> float:
    sched.step(step - sched.num_steps)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "style,step,expected",
    [
        ("linear", 0, 0.0),
        ("linear", 5, 0.5),  # warm-up: 5/10
        ("linear", 10, 1.0),
        ("linear", 60, 0.55),  # r = 0.5 -> 0.1 + 0.5 * 0.9
        ("linear", 200, 0.1),  # past decay
        ("cosine", 35, 0.8681980515),  # r = 0.25 -> 0.1 + 0.9 * 0.5 (cos(pi/4) + 1)
        ("cosine", 60, 0.55),
        ("cosine", 110, 0.1),
        ("constant", 5, 0.5),
        ("constant", 500, 1.0),
        ("inverse-square-root", 40, 0.5),  # sqrt(10) / sqrt(40)
        ("inverse-square-root", 90, 0.3333333333),  # sqrt(10 / 90)
        ("inverse-square-root", 111, 0.1),  # past decay -> min_lr
    ],
)
def test_lr_styles(style, step, expected):
    assert lr_at(make(lr_decay_style=style), step) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    "wsd_style,expected_95",
    [
        ("linear", 0.775),  # r' = 5/20 -> 0.1 + 0.9 * 0.75
        ("cosine", 0.8681980515),  # 0.1 + 0.9 * 0.5 (cos(pi/4) + 1)
        ("exponential", 0.7136135475),  # 0.1 + 0.9 * (2 * 0.5**0.25 - 1)
        ("minus_sqrt", 0.55),  # 0.1 + 0.9 * (1 - 0.5)
    ],
)
def test_wsd(wsd_style, expected_95):
    sched = make(lr_decay_style="WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert lr_at(sched, 5) == pytest.approx(0.5)
    assert lr_at(sched, 90) == pytest.approx(1.0)  # stable phase ends at 110 - 20
    assert lr_at(sched, 95) == pytest.approx(expected_95, abs=1e-9)
    assert lr_at(sched, 110) == pytest.approx(0.1, abs=1e-9)
    assert lr_at(sched, 111) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "style,step,expected",
    [
        ("linear", 25, 0.025),
        ("cosine", 25, 0.0146446609),  # 0.1 * 0.5 (cos(0.75 pi) + 1)
        ("cosine", 50, 0.05),
        ("linear", 150, 0.1),  # past the increment -> end_wd
    ],
)
def test_wd_styles(style, step, expected):
    sched = make(lr_decay_style="linear", start_wd=0.0, end_wd=0.1, wd_incr_style=style)
    sched.step(step)
    assert sched.get_wd() == pytest.approx(expected, abs=1e-9)
    assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected, abs=1e-9)


def test_constant_wd_and_group_multipliers():
    sched = make(lr_decay_style="linear")
    sched.step(60)
    g0, g1 = sched.optimizer.param_groups
    assert g0["weight_decay"] == pytest.approx(0.05) and g1["weight_decay"] == 0.0
    assert g0["lr"] == pytest.approx(0.55) and g1["lr"] == pytest.approx(0.275)


@pytest.mark.parametrize(
    "overrides,param,flag",
    [
        (dict(min_lr=2.0), "max_lr", "--lr"),
        (dict(lr_warmup_steps=200), "lr_warmup_steps", "--lr-warmup"),
        (dict(lr_decay_style="WSD"), "wsd_decay_steps", "--lr-wsd-decay"),
        (dict(lr_decay_style="exp"), "lr_decay_style", "--lr-decay-style"),
        (dict(start_wd=0.0, end_wd=0.1), "wd_incr_style", "--weight-decay-incr-style"),
        (
            dict(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True),
            "override_opt_param_scheduler",
            "--override-opt-param-scheduler",
        ),
    ],
)
def test_invalid_schedule_names_the_parameter_and_the_application_the_flag(overrides, param, flag):
    from megatron.training.user_errors import flag_message

    with pytest.raises(ConfigError, match=param) as e:
        make(**{"lr_decay_style": "linear", "use_checkpoint_opt_param_scheduler": False, **overrides})
    assert flag in flag_message(e.value)


def test_state_dict_flags():
    saved = make(lr_decay_style="cosine")
    saved.step(60)
    sd = saved.state_dict()

    strict = make(lr_decay_style="cosine", max_lr=2.0, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="max_lr"):
        strict.load_state_dict(sd)

    same = make(lr_decay_style="cosine", use_checkpoint_opt_param_scheduler=False)
    same.load_state_dict(sd)
    assert same.num_steps == 60 and same.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)

    from_ckpt = make(lr_decay_style="linear", max_lr=2.0, use_checkpoint_opt_param_scheduler=True)
    from_ckpt.load_state_dict(sd)
    assert from_ckpt.max_lr == 1.0 and from_ckpt.lr_decay_style == "cosine"

    override = make(
        lr_decay_style="linear",
        max_lr=2.0,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    override.load_state_dict(sd)
    assert override.max_lr == 2.0 and override.num_steps == 60
    assert override.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 + 0.5 * 1.9)
