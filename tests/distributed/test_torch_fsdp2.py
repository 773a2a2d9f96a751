"""TorchFullyShardedDataParallel (FSDP2): training over dp ranks (and x tp) matches one process;
its checkpoints load under the plain layout and the other way round."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import device, distributed_test
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from megatron.core import dist_checkpointing
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model

VOCAB, SEQ, MBS, MICRO, STEPS = 64, 16, 2, 2, 3
FSDP = DistributedDataParallelConfig(use_torch_fsdp2=True)


def _model(ps: ParallelState, swiglu: bool = False, recompute: str | None = None, ffn: int = 40) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=ffn if swiglu else None,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.tp_size,
        sequence_parallel=ps.tp_size > 1,
        share_embeddings_and_output_weights=True,
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_state=ps,
        device=device(),
        seed=7,
    )


def _batch(step: int, micro: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    full = torch.randint(0, VOCAB, (MBS * 4, SEQ), generator=g)  # the global micro-batch (dp <= 4)
    per = MBS * 4 // dp_size
    return full[dp_rank * per : (dp_rank + 1) * per].to(device())


def _optimizer(model: torch.nn.Module, ps: ParallelState, stats_group: dist.ProcessGroup | None) -> Any:
    config = OptimizerConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1)
    return get_megatron_optimizer(config, [model], grad_stats_group=stats_group, tp_rank=ps.tp_rank)


def _train(
    model: torch.nn.Module,
    ps: Any,
    stats_group: dist.ProcessGroup | None,
    steps: range = range(STEPS),
    opt: Any = None,
) -> list[tuple]:
    """Adam steps of MICRO micro-batches; (loss, grad norm) per step (loss averaged over dp)."""
    opt = _optimizer(model, ps, stats_group) if opt is None else opt
    out = []
    for step in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros((), device=device())
        for m in range(MICRO):
            ids = _batch(step, m, ps.dp_rank, ps.dp_size)
            ctx = model.no_sync() if m < MICRO - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(ids, None, None, labels=ids).mean() / MICRO
                loss.backward()
            total += loss.detach()
        finalize_model_grads([model])
        _, grad_norm, _ = opt.step()
        if ps.dp_size > 1:
            dist.all_reduce(total, group=ps.dp_cp_group)
        out.append((total.item() / ps.dp_size, grad_norm))
    return out


def _solo(swiglu: bool = False, recompute: str | None = None) -> tuple[list[tuple], GPTModel]:
    solo = ParallelState(grid=RankGrid(), rank=0)
    model = DistributedDataParallel(
        _model(solo).config, DistributedDataParallelConfig(), _model(solo, swiglu, recompute), solo
    )
    return _train(model, _Solo(solo), None), model.module


class _Solo:
    """The one process's view: dp 1, but it sees every dp rank's samples in each micro-batch."""

    def __init__(self, ps: ParallelState) -> None:
        self.tp_rank, self.dp_rank, self.dp_size, self.dp_cp_group = 0, 0, 1, None


def _check_against_solo(
    ps: ParallelState,
    swiglu: bool = False,
    recompute: str | None = None,
    ddp_config: DistributedDataParallelConfig = FSDP,
) -> None:
    model = TorchFullyShardedDataParallel(
        _model(ps).config, ddp_config, _model(ps, swiglu, recompute), parallel_state=ps
    )
    assert all(isinstance(p, DTensor) for p in model.module.parameters())
    assert all(not isinstance(p, DTensor) for p in model.parameters())
    assert unwrap_model(model) is model.module
    curve = _train(model, ps, dist.group.WORLD)
    reference, solo_model = _solo(swiglu, recompute)
    for (loss, norm), (ref_loss, ref_norm) in zip(curve, reference):
        assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    # The trained weights: gathered over dp, this rank's tp shard of the one-process weights.
    solo_sd = solo_model.sharded_state_dict()
    for name, p in model.module.named_parameters():
        st = solo_sd[name]
        full = p.full_tensor()
        ref = st.data
        if getattr(model._views[name], "tensor_model_parallel", False):
            ref = _tp_slice(solo_model, name, ps)
        # Adam normalises each update, so rounding-level gradient differences move weights by ~lr * 1e-4.
        assert_close(full, ref.view_as(full), rtol=1e-4, atol=1e-5, msg=name)


def _tp_slice(solo_model: GPTModel, name: str, ps: ParallelState) -> torch.Tensor:
    p = dict(solo_model.named_parameters())[name]
    dim, stride = getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1)
    if stride > 1:
        halves = p.data.chunk(stride, dim=dim)
        return torch.cat([h.chunk(ps.tp_size, dim=dim)[ps.tp_rank] for h in halves], dim=dim)
    return p.data.chunk(ps.tp_size, dim=dim)[ps.tp_rank]


@pytest.mark.parametrize("dp", [2, 4])
@distributed_test(world_size="dp")
def test_fsdp2_matches_one_process(ps: ParallelState, dp: int) -> None:
    _check_against_solo(ps, swiglu=dp == 4)


@distributed_test(world_size=4, tp=2)
def test_fsdp2_with_tp2_and_sequence_parallel_matches_one_process(ps: ParallelState) -> None:
    _check_against_solo(ps, swiglu=True)


@pytest.mark.parametrize("recompute", ["full", "selective"])
@distributed_test(world_size=2)
def test_fsdp2_with_recompute_matches_one_process(ps: ParallelState, recompute: str) -> None:
    _check_against_solo(ps, recompute=recompute)


@pytest.mark.parametrize(
    "ddp_config,gathered_after_forward",
    [
        (FSDP, False),
        (DistributedDataParallelConfig(use_torch_fsdp2=True, torch_fsdp2_reshard_after_forward=False), True),
        (
            DistributedDataParallelConfig(
                use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads"
            ),
            True,
        ),
    ],
)
@distributed_test(world_size=2)
def test_zero3_reshards_after_forward_and_zero2_keeps_layers_gathered_until_backward(
    ps: ParallelState, ddp_config: DistributedDataParallelConfig, gathered_after_forward: bool
) -> None:
    model = TorchFullyShardedDataParallel(_model(ps).config, ddp_config, _model(ps), parallel_state=ps)
    ids = _batch(0, 0, ps.dp_rank, ps.dp_size)
    loss = model(ids, None, None, labels=ids).mean()
    fc1 = model.module.decoder.layers[0].mlp.linear_fc1.weight  # what the layer holds between passes
    assert isinstance(fc1, DTensor) != gathered_after_forward
    loss.backward()
    if gathered_after_forward:
        _check_against_solo(ps, ddp_config=ddp_config)  # ZeRO-2 trains the same model


def _save(path: str, model: torch.nn.Module, opt: Any) -> None:
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, path)


def _load(path: str, model: torch.nn.Module, opt: Any) -> None:
    model_sd = model.sharded_state_dict()
    request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
    opt.load_sharded_state_dict(dist_checkpointing.load(request, path)["optimizer"])


@pytest.mark.parametrize("dp,swiglu", [(2, False), (4, True)])
@distributed_test(world_size="dp")
def test_fsdp2_checkpoint_resumes_under_plain_layout_and_back(
    ps: ParallelState, tmp_path, dp: int, swiglu: bool
) -> None:
    """Model and optimizer state of an FSDP2 run load into plain data parallelism (same keys and
    global shapes) and continue on the same losses; and the plain run's checkpoint loads into FSDP2.
    dp4 with SwiGLU's fc1 of 2 x 39 rows: rank 1's 20 rows [20, 40) span both halves (two blocks)."""
    fsdp = TorchFullyShardedDataParallel(
        _model(ps).config, FSDP, _model(ps, swiglu, ffn=39), parallel_state=ps
    )
    fsdp_opt = _optimizer(fsdp, ps, dist.group.WORLD)
    _train(fsdp, ps, dist.group.WORLD, range(0, 1), fsdp_opt)
    _save(str(tmp_path / "fsdp"), fsdp, fsdp_opt)
    plain_module = _model(ps, swiglu, ffn=39)
    with torch.no_grad():
        for p in plain_module.parameters():
            p.add_(1.0)  # other weights than the saved ones
    plain = DistributedDataParallel(plain_module.config, DistributedDataParallelConfig(), plain_module, ps)
    plain_opt = _optimizer(plain, ps, ps.mp_group)
    _load(str(tmp_path / "fsdp"), plain, plain_opt)
    for name, p in fsdp.module.named_parameters():
        assert torch.equal(p.full_tensor(), dict(plain_module.named_parameters())[name]), name
    if swiglu:
        fc1 = fsdp.sharded_state_dict()["decoder.layers.0.mlp.linear_fc1.weight"]
        assert len(fc1) == (2 if ps.dp_rank == 1 else 1)
    resumed = _train(plain, ps, ps.mp_group, range(1, 2), plain_opt)
    assert_close(resumed, _train(fsdp, ps, dist.group.WORLD, range(1, 2), fsdp_opt), rtol=1e-5, atol=1e-6)
    # And back: the plain run's checkpoint into a fresh FSDP2 chunk.
    _save(str(tmp_path / "plain"), plain, plain_opt)
    back = TorchFullyShardedDataParallel(
        _model(ps).config, FSDP, _model(ps, swiglu, ffn=39), parallel_state=ps
    )
    back_opt = _optimizer(back, ps, dist.group.WORLD)
    _load(str(tmp_path / "plain"), back, back_opt)
    assert_close(
        _train(back, ps, dist.group.WORLD, range(2, 3), back_opt),
        _train(plain, ps, ps.mp_group, range(2, 3), plain_opt),
        rtol=1e-5,
        atol=1e-6,
    )


@distributed_test(world_size=2)
def test_fsdp2_bf16_matches_plain_bf16_and_composes_with_optimizer_cpu_offload(ps: ParallelState) -> None:
    """--bf16: sharded params stay fp32 (the main params), compute in bf16, gradients reduced in fp32;
    the losses are the plain bf16 run's (fp32 main params and grads there too). And the optimizer's
    CPU offload steps the local fp32 shards as it steps whole params: the same losses as without."""
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )

    def build() -> GPTModel:
        return GPTModel(
            cfg, get_gpt_layer_local_spec(), VOCAB, SEQ, parallel_state=ps, device=device(), seed=7
        )

    def bf16_optimizer(model: torch.nn.Module, group: Any, **offload: Any) -> Any:
        config = OptimizerConfig(lr=1e-2, clip_grad=0.05, bf16=True, **offload)
        return get_megatron_optimizer(config, [model], grad_stats_group=group, tp_rank=ps.tp_rank)

    fsdp = TorchFullyShardedDataParallel(cfg, FSDP, build(), parallel_state=ps)
    assert {p.dtype for p in fsdp.parameters()} == {torch.float32}
    world = dist.group.WORLD
    curve = _train(fsdp, ps, world, range(3), bf16_optimizer(fsdp, world))
    plain = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build(), ps)
    assert_close(curve, _train(plain, ps, ps.mp_group, range(3), bf16_optimizer(plain, ps.mp_group)))
    # fp32 params (CPU offload keeps a host copy of each offloaded local shard, steps it there and
    # copies it back); the host step is torch's fused AdamW: rounding-level differences.
    offload = OptimizerConfig(
        lr=1e-2, clip_grad=0.05, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5
    )
    runs = []
    for config in (offload, OptimizerConfig(lr=1e-2, clip_grad=0.05)):
        model = TorchFullyShardedDataParallel(_model(ps).config, FSDP, _model(ps), parallel_state=ps)
        opt = get_megatron_optimizer(config, [model], grad_stats_group=world, tp_rank=ps.tp_rank)
        host = [m for p, m in zip(opt.model_params, opt.main_params) if m is not p]
        assert bool(host) == config.optimizer_cpu_offload  # offloaded shards: a host copy of their own
        runs.append(_train(model, ps, world, range(3), opt))
    assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)
