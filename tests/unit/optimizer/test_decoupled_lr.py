"""--decoupled-lr: the embedding and output layer weights get groups of their own that follow
decoupled_lr / decoupled_min_lr on the same warm-up and decay; checkpoints keep the values."""

from __future__ import annotations

import math

import pytest
import torch
from test_optim_checkpoint import emulate_load, model_sharded

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class TinyLM(torch.nn.Module):
    """Megatron's parameter names: word and position embeddings, one layer, output layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(16, 8)
        self.embedding.position_embeddings = torch.nn.Embedding(4, 8)
        self.decoder = torch.nn.Linear(8, 8)
        self.output_layer = torch.nn.Linear(8, 16, bias=False)

    def forward(self, tokens):  # [b, s] -> [b, s, V]
        pos = torch.arange(tokens.shape[1])
        return self.output_layer(
            self.decoder(self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(pos))
        )


def build(decoupled_lr=0.5, decoupled_min_lr=0.01, **sched):
    model = TinyLM()
    opt = get_megatron_optimizer(
        OptimizerConfig(
            lr=1.0, min_lr=0.1, decoupled_lr=decoupled_lr, decoupled_min_lr=decoupled_min_lr, weight_decay=0.0
        ),
        [model],
    )
    args = dict(
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=110,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
    )
    return model, opt, OptimizerParamScheduler(opt, **{**args, **sched})


def cosine(step: int, peak: float, floor: float) -> float:
    if step <= 10:
        return peak * step / 10
    return floor + (peak - floor) * 0.5 * (math.cos(math.pi * (step - 10) / 100) + 1)


def lrs(opt) -> dict[str, float]:
    return {g["name"]: g["lr"] for g in opt.param_groups}


def test_groups_hold_the_embedding_and_output_weights():
    model, opt, _ = build()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    assert groups == {
        "decay": ["decoder.weight", "embedding.position_embeddings.weight"],
        "no_decay": ["decoder.bias"],
        "decoupled_decay": ["embedding.word_embeddings.weight", "output_layer.weight"],
    }
    plain = get_megatron_optimizer(OptimizerConfig(lr=1.0), [TinyLM()])
    assert [g["name"] for g in plain.param_groups] == ["decay", "no_decay"]  # no flag: no extra groups


def test_lrs_follow_their_own_schedule_over_training_steps():
    model, opt, sched = build()
    tokens = torch.randint(0, 16, (2, 4))
    for step in range(1, 7):  # up to 96 of the 110 decay samples
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step(16)  # 16 samples a step
        n = 16 * step
        got = lrs(opt)
        assert got["decay"] == pytest.approx(cosine(n, 1.0, 0.1)) and got["no_decay"] == got["decay"]
        assert got["decoupled_decay"] == pytest.approx(cosine(n, 0.5, 0.01))
    sched.step(1000)
    assert lrs(opt)["decoupled_decay"] == pytest.approx(0.01) and lrs(opt)["decay"] == pytest.approx(0.1)


def test_floor_defaults_to_min_lr_and_is_checked():
    _, opt, sched = build(decoupled_min_lr=None)
    sched.step(500)
    assert lrs(opt)["decoupled_decay"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="decoupled_lr .* must be >= its floor"):
        build(decoupled_lr=0.05, decoupled_min_lr=None)


def test_checkpoint_keeps_the_decoupled_values():
    model, opt, sched = build()
    sched.step(40)
    sd = sched.state_dict()
    assert sd["decoupled_lr"] == 0.5 and sd["decoupled_min_lr"] == 0.01
    common = emulate_load(opt.sharded_state_dict(model_sharded(model)))["common"]
    assert common["param_groups"]["decoupled_decay"]["max_lr"] == 0.5

    _, _, other = build(decoupled_lr=0.25)
    with pytest.raises(ValueError, match="decoupled_lr"):
        other.load_state_dict(sd)
    _, opt2, from_ckpt = build(decoupled_lr=0.25, use_checkpoint_opt_param_scheduler=True)
    from_ckpt.load_state_dict(sd)
    assert from_ckpt.decoupled_lr == 0.5 and lrs(opt2)["decoupled_decay"] == pytest.approx(
        cosine(40, 0.5, 0.01)
    )


def test_resume_from_a_checkpoint_without_decoupled_groups():
    """Turning --decoupled-lr on at a resume: the new groups take their step count from the old groups."""
    plain_model = TinyLM()
    plain = get_megatron_optimizer(OptimizerConfig(lr=1.0, weight_decay=0.0), [plain_model])
    plain_model(torch.randint(0, 16, (2, 4))).sum().backward()
    plain.step()
    loaded = emulate_load(plain.sharded_state_dict(model_sharded(plain_model)))
    old_sched = OptimizerParamScheduler(
        plain,
        0.0,
        1.0,
        0.1,
        10,
        110,
        "cosine",
        0.0,
        0.0,
        110,
        "constant",
        use_checkpoint_opt_param_scheduler=False,
    ).state_dict()
    del old_sched["decoupled_lr"], old_sched["decoupled_min_lr"]  # as saved before the flag existed

    model, opt, sched = build()
    opt.sharded_state_dict(model_sharded(model))
    opt.load_sharded_state_dict(loaded)
    steps = {g["name"]: float(opt.optimizer.state[g["params"][0]]["step"]) for g in opt.param_groups}
    assert steps == {"decay": 1.0, "no_decay": 1.0, "decoupled_decay": 1.0}
    with pytest.raises(ValueError, match="decoupled_lr: this run's value \\(0.5\\) differs"):
        sched.load_state_dict(old_sched)
    _, _, override = build(override_opt_param_scheduler=True)
    override.load_state_dict(old_sched)
    assert override.decoupled_lr == 0.5
