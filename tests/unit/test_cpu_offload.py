"""Optimizer CPU offload (--optimizer-cpu-offload): the same training as without it, state in host tensors.

On the CPU the "device" and the host are one, so these tests cover every path except pinned memory
and the side CUDA streams (tests/gpu and bench/bench_offload.py run those).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.execution_plan import ExecutionPlan
from megatron.core.fusions.kernels import optimizer_line
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, cpu_offload, get_megatron_optimizer
from megatron.core.optimizer import optimizer as optimizer_module
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.distributed.harness import run_distributed


class TinyMLP(torch.nn.Module):
    """fc1 -> layernorm -> gelu -> fc2: 2-D weights, biases and a 1-D norm weight."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, 8] -> [b, 4]
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def build(dtype: torch.dtype, seed: int = 0, **kw) -> tuple[TinyMLP, object, OptimizerParamScheduler]:
    model = TinyMLP(dtype, seed)
    kw.setdefault("clip_grad", 0.05)  # below the grad norm: clipping acts every step
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=dtype == torch.bfloat16, **kw)
    opt = get_megatron_optimizer(config, [model])
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


def train(model, opt, sched, steps: range, main_grad: bool = False) -> list[tuple[float, float]]:
    """(loss, grad norm) per step; ``main_grad`` emulates DDP's fp32 gradient buffers."""
    dtype = next(model.parameters()).dtype
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        if main_grad:
            for p in model.parameters():
                if getattr(p, "main_grad", None) is None:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.main_grad.add_(p.grad.float())
                p.grad = None
        ok, norm, _ = opt.step()
        assert ok
        sched.step(32)
        opt.zero_grad()
        out.append((loss.item(), norm))
    return out


def offload(fraction: float, **kw) -> dict:
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, **kw)


CASES = {
    "adam_fp32": (torch.float32, {}),
    "adam_bf16": (torch.bfloat16, {}),
    "adam_bf16_main_grad": (torch.bfloat16, {"main_grad": True}),
    "sgd_fp32": (torch.float32, {"optimizer": "sgd"}),
    "sgd_bf16": (torch.bfloat16, {"optimizer": "sgd"}),
}


def _run(case: str, steps: range, **kw) -> tuple[list, list[torch.Tensor]]:
    dtype, extra = CASES[case]
    extra = dict(extra)
    main_grad = extra.pop("main_grad", False)
    model, opt, sched = build(dtype, **extra, **kw)
    losses = train(model, opt, sched, steps, main_grad)
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_training_matches(case, fraction):
    """Losses, grad norms and weights over 6 steps with clipping: bitwise with the same kernels on
    both sides (--no-use-fused-adam: torch's single-tensor step), within fp32 rounding with the
    fused CPU AdamW against the device's one-pass step."""
    same_kernels = dict(use_fused_adam=False)
    ref, ref_w = _run(case, range(6), **same_kernels)
    got, got_w = _run(case, range(6), **same_kernels, **offload(fraction))
    assert got == ref
    for a, b in zip(got_w, ref_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref, ref_w = _run(case, range(6))
    got, got_w = _run(case, range(6), **offload(fraction))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-7)
    for a, b in zip(got_w, ref_w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_optimizer_as_is_matches():
    """use_torch_optimizer_for_cpu_offload: torch.optim.AdamW's own kernel choice on the host."""
    ref, _ = _run("adam_fp32", range(4), use_fused_adam=False)
    got, _ = _run(
        "adam_fp32", range(4), use_fused_adam=False, use_torch_optimizer_for_cpu_offload=True, **offload(1.0)
    )
    assert got == ref


def test_fraction_selects_by_element_count():
    params = [torch.zeros(n) for n in (40, 10, 30, 20)]
    assert cpu_offload.select_offloaded(params, 0.5) == [True, True, False, False]
    assert cpu_offload.select_offloaded(params, 0.55) == [True, True, False, False]
    assert cpu_offload.select_offloaded(params, 0.7) == [True, True, False, True]
    assert cpu_offload.select_offloaded(params, 1.0) == [True] * 4
    assert cpu_offload.select_offloaded(params, 0.0) == [False] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_state_lives_in_host_tensors(dtype, monkeypatch):
    """The offloaded params' main copies and moments are their own tensors, the device step never
    receives them, and the host step does (in chunks)."""
    model, opt, sched = build(dtype, **offload(0.5))
    offloaded = [(p, m) for p, m in zip(opt.model_params, opt.main_params) if opt._offload.holds(m)]
    on_device = [m for m in opt.main_params if not opt._offload.holds(m)]
    assert offloaded and on_device
    assert sum(m.numel() for _, m in offloaded) <= 0.5 * sum(p.numel() for p in model.parameters())
    assert len(opt._offload.chunks) > 1
    device_stepped: set[int] = set()
    real_step = optimizer_module.adamw_step

    def spy(optimizer, model_params, divisor, grads=None, **kw):
        device_stepped.update(grads or {})
        return real_step(optimizer, model_params, divisor, grads=grads, **kw)

    monkeypatch.setattr(optimizer_module, "adamw_step", spy)
    before = [m.clone() for _, m in offloaded]
    train(model, opt, sched, range(2))
    assert device_stepped == {id(m) for m in on_device}
    for (model_p, main), old in zip(offloaded, before):
        assert main.data_ptr() != model_p.data_ptr()
        assert not torch.equal(main, old)  # the host step updated it
        state = opt.optimizer.state[main]
        for kind in ("exp_avg", "exp_avg_sq"):
            assert state[kind].data_ptr() not in {model_p.data_ptr(), main.data_ptr()}
            assert state[kind].abs().sum() > 0
        torch.testing.assert_close(model_p.detach().float(), main.to(dtype).float(), rtol=0, atol=0)
    numel = sum(m.numel() for _, m in offloaded)
    assert opt._offload.host_bytes() >= 12 * numel
    assert f"({numel} elements)" in opt._offload.describe()


def test_offload_fraction_zero_is_plain():
    _, opt, _ = build(torch.float32, **offload(0.0))
    assert opt._offload is None


def test_start_up_lines_say_what_is_offloaded():
    """The optimizer's start-up line and the kernel report's optimizer line name the offload; without
    offload neither does."""
    _, opt, _ = build(torch.bfloat16, **offload(0.5))
    summary = opt.offload_summary()
    assert summary is not None and "host memory" in summary and "stepped on the CPU" in summary
    _, plain, _ = build(torch.bfloat16)
    assert plain.offload_summary() is None
    plan = ExecutionPlan.plain(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2))
    assert "0.5 of the params' main copies and state in host memory" in optimizer_line(
        OptimizerConfig(lr=1e-3, **offload(0.5)), plan
    )
    assert "host memory" not in optimizer_line(OptimizerConfig(lr=1e-3), plan)


# ---------------------------------------------------------------- checkpoints


def model_sharded(model: torch.nn.Module) -> dict:
    return {
        name: ShardedTensor(f"model.{name}", p, p.shape, (0,) * p.dim())
        for name, p in model.named_parameters()
    }


def emulate_load(obj):
    """What dist_checkpointing.load returns for a sharded state dict: plain tensors and objects."""
    if isinstance(obj, ShardedTensor):
        return obj.data.detach().clone()
    if isinstance(obj, ShardedObject):
        return copy.deepcopy(obj.data)
    if isinstance(obj, dict):
        return {k: emulate_load(v) for k, v in obj.items()}
    return obj


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    if isinstance(obj, ShardedTensor):
        return {prefix + obj.key: obj.data}
    return {prefix: obj}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_state_same_keys_and_values(dtype):
    """An offloaded run's sharded optimizer state has the keys and values of the same run without."""
    states = []
    for kw in ({}, offload(1.0)):
        model, opt, sched = build(dtype, use_fused_adam=False, **kw)
        train(model, opt, sched, range(3))
        states.append(_flat(opt.sharded_state_dict(model_sharded(model))))
    plain, offloaded = states
    assert sorted(plain) == sorted(offloaded)
    for key, value in plain.items():
        other = offloaded[key]
        if torch.is_tensor(value):
            torch.testing.assert_close(other, value, rtol=0, atol=0)
        elif isinstance(value, ShardedObject):
            assert isinstance(other, ShardedObject) and other.key == value.key


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction", ["offload_to_plain", "plain_to_offload"])
def test_checkpoint_resumes_across_offload(dtype, sharded, direction):
    """4 steps, save, resume in a fresh optimizer with offload switched, 4 more: the weights of the
    uninterrupted 8 steps, bit for bit (single-tensor kernels on both sides)."""
    first, second = (offload(0.5), {}) if direction == "offload_to_plain" else ({}, offload(1.0))
    model, opt, sched = build(dtype, use_fused_adam=False)
    straight = train(model, opt, sched, range(8))

    model, opt, sched = build(dtype, use_fused_adam=False, **first)
    train(model, opt, sched, range(4))
    if sharded:
        saved = roundtrip(emulate_load(opt.sharded_state_dict(model_sharded(model))))
    else:
        saved = roundtrip(opt.state_dict())
    saved_model, saved_sched = roundtrip(model.state_dict()), roundtrip(sched.state_dict())

    model, opt, sched = build(dtype, seed=123, use_fused_adam=False, **second)
    model.load_state_dict(saved_model)
    if sharded:
        opt.load_sharded_state_dict(saved, model_sharded(model))
    else:
        opt.load_state_dict(saved)
    sched.load_state_dict(saved_sched)
    resumed = train(model, opt, sched, range(4, 8))
    assert resumed == straight[4:]


def test_reload_model_params_refreshes_host_mains():
    model, opt, _ = build(torch.float32, **offload(1.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.reload_model_params()
    for p, m in zip(opt.model_params, opt.main_params):
        torch.testing.assert_close(m, p.detach(), rtol=0, atol=0)


# ---------------------------------------------------------------- with the distributed optimizer
VOCAB, SEQ, MICRO, GLOBAL = 64, 16, 2, 8  # GLOBAL samples per step over MICRO micro-batches


def _forward_step(data_iterator, model):
    ids = next(data_iterator)
    out = model(ids, None, None, labels=ids)
    return out, lambda y: (y.float().mean(), {"lm loss": y.detach().float().mean()})


def _distopt_run(ps: ParallelState, bf16: bool, offload_kw: dict) -> tuple[list, torch.Tensor, dict]:
    """4 steps of a 2-layer GPT under DDP with the bucket-sharded distributed optimizer (overlapped
    reduce-scatter and all-gather): (losses and grad norms, weights, flat sharded optimizer state)."""
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    module = GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, parallel_state=ps, seed=7
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=2000
    )
    model = DistributedDataParallel(module.config, ddp_config, module, ps)
    module.config.no_sync_func = model.no_sync
    module.config.finalize_model_grads_func = None
    config = OptimizerConfig(
        lr=3e-3, weight_decay=0.1, clip_grad=0.05, bf16=bf16, use_fused_adam=False, **offload_kw
    )
    opt = get_megatron_optimizer(config, [model], grad_stats_group=ps.mp_group, tp_rank=ps.tp_rank)
    assert isinstance(opt, DistributedOptimizer)
    assert (opt._offload is not None) == bool(offload_kw)
    schedule = get_forward_backward_func(ps.pp_size, 1)
    curve = []
    for step in range(4):
        model.zero_grad_buffer()
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 + step)
        full = torch.randint(0, VOCAB, (MICRO, GLOBAL // MICRO, SEQ), generator=g)
        mbs = GLOBAL // MICRO // ps.dp_size
        batches = [full[m, ps.dp_rank * mbs : (ps.dp_rank + 1) * mbs] for m in range(MICRO)]
        metrics = schedule(
            forward_step_func=_forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=mbs,
        )
        finalize_model_grads([model])
        ok, grad_norm, _ = opt.step()
        assert ok
        curve.append((sum(float(m["lm loss"]) for m in metrics), grad_norm))
    opt.finish_param_sync()
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])
    model_sd = model.sharded_state_dict()
    state = {k: v.clone() for k, v in _flat(opt.sharded_state_dict(model_sd)).items() if torch.is_tensor(v)}
    return curve, weights, state


def _distopt_body(ps: ParallelState, bf16: bool) -> None:
    ref_curve, ref_weights, ref_state = _distopt_run(ps, bf16, {})
    curve, weights, state = _distopt_run(ps, bf16, offload(0.5))
    assert curve == ref_curve
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
    assert sorted(state) == sorted(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_distributed_optimizer_pieces_offload(bf16):
    """dp2 with the bucket-sharded distributed optimizer, half of each rank's pieces offloaded: the
    losses, grad norms, weights and sharded optimizer state of the run without offload, bit for bit."""
    run_distributed(_distopt_body, 2, kwargs=dict(bf16=bf16))
