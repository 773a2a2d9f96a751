"""Exact resume through state_dict and through the sharded (distributed-checkpoint) state dict."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

SETUPS = {
    "adam_bf16": (torch.bfloat16, dict(bf16=True)),
    "adam_fp16_dynamic": (torch.float16, dict(fp16=True, initial_loss_scale=2.0**12, loss_scale_window=2)),
    "sgd_fp32": (torch.float32, dict(optimizer="sgd", sgd_momentum=0.9)),
}


def build(tools, name: str, seed: int = 0):
    dtype, kw = SETUPS[name]
    model = tools["TinyMLP"](dtype, seed=seed)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, **kw), [model])
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=64,
        lr_decay_steps=320,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=320,
        wd_incr_style="linear",
    )
    return model, opt, sched


def model_sharded(model: torch.nn.Module) -> dict:
    """Emulate a TP-2 rank-1 shard along dim 0 for every param, with replica id 1."""
    sd = {}
    for name, p in model.named_parameters():
        shape = (2 * p.shape[0], *p.shape[1:])
        offset = (p.shape[0],) + (0,) * (p.dim() - 1)
        sd[name] = ShardedTensor(f"model.{name}", p, shape, offset, replica_id=1)
    return {"chunk0": sd}


def emulate_load(obj):
    """What dist_checkpointing.load returns: plain tensors / objects in place of the sharded leaves."""
    if isinstance(obj, ShardedTensor):
        return obj.data.detach().clone()
    if isinstance(obj, ShardedObject):
        return copy.deepcopy(obj.data)
    if isinstance(obj, dict):
        return {k: emulate_load(v) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("sharded", [False, True])
def test_resume_is_bitwise_identical(tools, setup, sharded):
    model, opt, sched = build(tools, setup)
    tools["train_steps"](model, opt, range(8), scheduler=sched)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = build(tools, setup)
    tools["train_steps"](model, opt, range(4), scheduler=sched)
    if sharded:
        saved = tools["roundtrip"](emulate_load(opt.sharded_state_dict(model_sharded(model))))
    else:
        saved = tools["roundtrip"](opt.state_dict())
    saved_model = tools["roundtrip"](model.state_dict())
    saved_sched = tools["roundtrip"](sched.state_dict())
    scale = opt.get_loss_scale()

    model, opt, sched = build(tools, setup, seed=123)  # a fresh process with other weights
    model.load_state_dict(saved_model)
    if sharded:
        opt.sharded_state_dict(model_sharded(model))
        opt.load_sharded_state_dict(saved)
    else:
        opt.load_state_dict(saved)
    sched.load_state_dict(saved_sched)
    assert opt.get_loss_scale() == scale
    tools["train_steps"](model, opt, range(4, 8), scheduler=sched)
    for p, s in zip(model.parameters(), straight):
        assert torch.equal(p, s)


def test_sharded_state_dict_layout(tools):
    model, opt, _ = build(tools, "adam_bf16")
    sd = opt.sharded_state_dict(model_sharded(model))  # before any step: state initialised lazily
    assert set(sd) == {"param_state", "common"}
    assert isinstance(sd["common"], ShardedObject) and sd["common"].key == "optimizer.common"
    common = sd["common"].data
    assert common["param_groups"]["decay"]["step"] == 0.0 and common["grad_scaler"] is None
    w = sd["param_state"]["model.fc1.weight"]
    assert set(w) == {"fp32_param", "exp_avg", "exp_avg_sq"}
    for kind, st in w.items():
        assert st.key == f"optimizer.state.{kind}.model.fc1.weight"
        assert st.global_shape == (32, 8) and st.global_offset == (16, 0) and st.replica_id == 1
        assert st.data.dtype == torch.float32 and st.data.shape == (16, 8)
    assert torch.equal(w["fp32_param"].data, model.fc1.weight.float())
    assert len(sd["param_state"]) == 6

    model, opt, _ = build(tools, "sgd_fp32")
    sd = opt.sharded_state_dict(model_sharded(model))
    assert set(sd["param_state"]["model.fc2.bias"]) == {"momentum_buffer"}  # fp32: no separate main copy


def test_lazy_state_does_not_change_training(tools):
    for setup in ("adam_bf16", "sgd_fp32"):
        model_a, opt_a, _ = build(tools, setup)
        model_b, opt_b, _ = build(tools, setup)
        opt_b.init_state()
        tools["train_steps"](model_a, opt_a, range(3))
        tools["train_steps"](model_b, opt_b, range(3))
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(a, b)


def test_missing_param_and_wrong_optimizer_are_errors(tools):
    model, opt, _ = build(tools, "adam_bf16")
    partial = model_sharded(model)
    del partial["chunk0"]["fc2.bias"]
    with pytest.raises(CheckpointError, match="no ShardedTensor"):
        opt.sharded_state_dict(partial)
    loaded = emulate_load(opt.sharded_state_dict(model_sharded(model)))
    loaded["common"]["optimizer"] = "sgd"
    with pytest.raises(CheckpointError, match="optimizer state is for optimizer 'sgd'"):
        opt.load_sharded_state_dict(loaded)


def test_reload_model_params(tools):
    model, opt, _ = build(tools, "adam_bf16")
    with torch.no_grad():
        model.fc1.weight.fill_(0.25)
    opt.reload_model_params()
    assert torch.equal(opt.main_params[0], torch.full((16, 8), 0.25))
