"""Megatron-Core 0.19.2's optimizer, scheduler, micro-batch calculator and schedule surface: names,
signatures, defaults and the documented behaviour behind them."""

import inspect
import math
import types

import pytest
import torch

from megatron.core import num_microbatches_calculator as nmc
from megatron.core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.optimizer_config import NO_EFFECT, REFUSED
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

F32 = torch.float32
# Megatron-Core 0.19.2's OptimizerConfig fields and defaults (min_lr: see test_min_lr_none_means_zero).
MCORE_OPTIMIZER_CONFIG = dict(
    lr=None,
    decoupled_lr=None,
    decoupled_min_lr=None,
    weight_decay=0.01,
    apply_wd_to_qk_layernorm=False,
    fp8_recipe=None,
    fp16=False,
    bf16=False,
    reuse_grad_buf_for_mxfp8_param_ag=False,
    params_dtype=F32,
    use_precision_aware_optimizer=False,
    store_param_remainders=True,
    main_grads_dtype=F32,
    main_params_dtype=F32,
    exp_avg_dtype=F32,
    exp_avg_sq_dtype=F32,
    optimizer="adam",
    loss_scale=None,
    initial_loss_scale=4294967296,
    min_loss_scale=1.0,
    loss_scale_window=1000,
    hysteresis=2,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_eps=1e-08,
    decoupled_weight_decay=True,
    sgd_momentum=0.9,
    muon_momentum=0.95,
    muon_split_qkv=True,
    muon_nesterov=False,
    muon_scale_mode="spectral",
    muon_fp32_matmul_prec="medium",
    muon_coefficient_type="quintic",
    muon_num_ns_steps=5,
    muon_tp_mode="blockwise",
    muon_extra_scale_factor=1.0,
    muon_scalar_optimizer="adam",
    lion_beta1=0.95,
    lion_beta2=0.98,
    soap_shampoo_beta=0.95,
    soap_precondition_frequency=1,
    soap_use_kl_shampoo=True,
    adaptive_muon_moment2_method="adamuon",
    adaptive_muon_beta2=0.95,
    adaptive_muon_eps=1e-08,
    use_distributed_optimizer=False,
    use_layer_wise_distributed_optimizer=False,
    overlap_param_gather=False,
    overlap_param_gather_with_optimizer_step=False,
    optimizer_cpu_offload=False,
    optimizer_offload_fraction=0.0,
    use_torch_optimizer_for_cpu_offload=False,
    overlap_cpu_optimizer_d2h_h2d=False,
    pin_cpu_grads=True,
    pin_cpu_params=True,
    clip_grad=1.0,
    grad_norm_skip_threshold=math.inf,
    log_num_zeros_in_grad=False,
    barrier_with_L1_time=False,
    timers=None,
    config_logger_dir="",
    optimizer_cuda_graph=False,
)


def test_optimizer_config_has_every_field_with_megatron_default():
    cfg = OptimizerConfig()
    for name, default in MCORE_OPTIMIZER_CONFIG.items():
        assert getattr(cfg, name) == default, name
    assert set(NO_EFFECT) | set(REFUSED) <= set(MCORE_OPTIMIZER_CONFIG)


def test_min_lr_none_means_zero():
    assert OptimizerConfig(min_lr=None).min_lr == 0.0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_name_themselves(name):
    built = REFUSED[name][0]
    other = torch.bfloat16 if isinstance(built, torch.dtype) else not built
    with pytest.raises(ValueError, match=f"OptimizerConfig.{name}="):
        OptimizerConfig(**{name: other})


def test_no_effect_fields_are_taken():
    OptimizerConfig(
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        fp8_recipe="delayed",
        params_dtype=torch.bfloat16,
        barrier_with_L1_time=True,
        muon_momentum=0.5,
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _backward(model):
    model(torch.randn(5, 4)).square().sum().backward()


def test_get_megatron_optimizer_signature_and_step_triple():
    names = list(inspect.signature(get_megatron_optimizer).parameters)
    assert names[:6] == [
        "config",
        "model_chunks",
        "config_overrides",
        "use_gloo_process_groups",
        "pg_collection",
        "dump_param_to_param_group_map",
    ]
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1), [model], None, False, None, None)
    assert isinstance(opt, MegatronOptimizer) and not isinstance(opt, DistributedOptimizer)
    _backward(model)
    expected = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())).item()
    ok, grad_norm, num_zeros = opt.step()
    assert ok is True and grad_norm == pytest.approx(expected, rel=1e-5) and num_zeros is None


def test_get_megatron_optimizer_refuses_what_is_not_built():
    with pytest.raises(ValueError, match="config_overrides"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1), [_model()], config_overrides={"key": "value"})
    with pytest.raises(ValueError, match="dump_param_to_param_group_map"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1), [_model()], dump_param_to_param_group_map="x.json")


def test_grad_norm_skip_threshold_skips_the_update():
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, grad_norm_skip_threshold=1e-6), [model])
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    ok, grad_norm, _ = opt.step()
    assert ok is False and grad_norm > 1e-6
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_chained_optimizer_combines_the_norms():
    a, b = _model(), _model()
    opts = [get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0), [m]) for m in (a, b)]
    chain = ChainedOptimizer(opts)
    assert len(chain.param_groups) == sum(len(o.param_groups) for o in opts)
    _backward(a)
    _backward(b)
    sq = sum(p.grad.square().sum().item() for m in (a, b) for p in m.parameters())
    ok, grad_norm, _ = chain.step()
    assert ok and grad_norm == pytest.approx(math.sqrt(sq), rel=1e-5)
    with pytest.raises(ValueError, match="clip_grad=0"):
        ChainedOptimizer([get_megatron_optimizer(OptimizerConfig(lr=0.1), [m]) for m in (a, b)])


def _groups():
    return types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])


def test_scheduler_cosine_follows_megatron_formula():
    init, peak, floor, warmup, decay = 0.0, 1.0, 0.1, 4, 20
    opt = _groups()
    sched = OptimizerParamScheduler(
        optimizer=opt,
        init_lr=init,
        max_lr=peak,
        min_lr=floor,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=decay,
        wd_incr_style="linear",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
        wsd_decay_steps=None,
        lr_wsd_decay_style=None,
    )
    for step in range(1, 25):
        sched.step(1)
        if step <= warmup:
            lr = init + (peak - init) * step / warmup
        elif step > decay:
            lr = floor
        else:
            lr = floor + 0.5 * (math.cos(math.pi * (step - warmup) / (decay - warmup)) + 1.0) * (peak - floor)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr), step
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * min(step, decay) / decay), step


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_scheduler_wsd_follows_megatron_formula(style):
    decay, wsd = 20, 8
    coeff = {
        "linear": lambda r: 1.0 - r,
        "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
        "exponential": lambda r: 2.0 * 0.5**r - 1.0,
        "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
    }[style]
    opt = _groups()
    sched = OptimizerParamScheduler(
        opt,
        0.0,
        1.0,
        0.0,
        2,
        decay,
        "WSD",
        0.01,
        0.01,
        decay,
        "constant",
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=style,
    )
    for step in range(3, decay + 1):
        sched.step(1) if step > 3 else sched.step(3)
        r = max(0, step - (decay - wsd)) / wsd
        assert opt.param_groups[0]["lr"] == pytest.approx(coeff(r) if r > 0 else 1.0), step


def test_scheduler_get_wd_reads_the_group():
    opt = _groups()
    sched = OptimizerParamScheduler(opt, 0.0, 1.0, 0.0, 0, 10, "constant", 0.0, 0.2, 10, "linear")
    sched.step(5)
    assert sched.get_wd() == pytest.approx(0.1)
    assert sched.get_wd({"start_wd": 0.0, "end_wd": 0.4}) == pytest.approx(0.2)


def test_num_microbatches_calculator_keywords_and_defaults():
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(
        rank=0, global_batch_size=16, micro_batch_size=2, data_parallel_size=2
    )
    try:
        assert nmc.get_num_microbatches() == 4 and nmc.get_current_global_batch_size() == 16
        assert nmc.get_micro_batch_size() == 2
    finally:
        nmc.unset_num_microbatches_calculator()
    with pytest.raises(ValueError, match="micro_batch_size is required"):
        nmc.reconfigure_num_microbatches_calculator(0, None, 16, None, 2)


MEGATRON_SCHEDULE_KWARGS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "num_microbatches",
    "seq_length",
    "micro_batch_size",
    "decoder_seq_length",
    "forward_only",
    "collect_non_loss_data",
    "first_val_step",
    "adjust_tensor_shapes_fn",
    "p2p_communicator",
    "pg_collection",
    "force_all_reduce",
)


@pytest.mark.parametrize("pp, vp", [(1, None), (2, None), (2, 2)])
def test_schedules_take_megatron_keywords(pp, vp):
    assert list(inspect.signature(get_forward_backward_func).parameters)[:3] == [
        "pp_size",
        "vp_size",
        "schedule_pg_collection",
    ]
    func = get_forward_backward_func(pp, vp)
    params = inspect.signature(func).parameters
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in MEGATRON_SCHEDULE_KWARGS)
    with pytest.raises(ValueError, match="force_all_reduce"):
        func(
            forward_step_func=None, data_iterator=None, model=None, num_microbatches=1, force_all_reduce=True
        )


def test_get_forward_backward_func_refuses_multi_module():
    assert get_forward_backward_func(2, vp_size=2) is get_forward_backward_func(2, vpp_size=2)
    with pytest.raises(ValueError, match="schedule_pg_collection"):
        get_forward_backward_func(1, None, object())


def test_no_pipelining_runs_with_megatron_keywords():
    model = torch.nn.Linear(3, 1)
    model.config = types.SimpleNamespace(
        no_sync_func=None,
        calculate_per_token_loss=False,
        grad_scale_func=None,
        finalize_model_grads_func=None,
    )
    batches = iter([torch.ones(2, 3), 2 * torch.ones(2, 3)])

    def forward_step_func(data_iterator, model):
        out = model(next(data_iterator))
        return out, lambda o: (o.sum(), {"loss": o.sum().detach()})

    metrics = schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step_func,
        data_iterator=batches,
        model=[model],
        num_microbatches=2,
        seq_length=3,
        micro_batch_size=2,
        decoder_seq_length=None,
        forward_only=False,
        collect_non_loss_data=False,
        first_val_step=None,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce=False,
    )
    assert len(metrics) == 2
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 3.0))  # (2*1 + 2*2) / 2 micro-batches
