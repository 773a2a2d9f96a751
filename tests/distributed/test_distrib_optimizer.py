"""The bucket-sharded distributed optimizer (Megatron's layout) and layout-independent optimizer checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import device, distributed_test, run_distributed
from torch.testing import assert_close

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.flat_ranges import flat_range_blocks
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import memory_report
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig


def _adam_after_steps(params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> MegatronOptimizer:
    opt = MegatronOptimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1), [{"params": params, "name": "decay"}])
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        assert opt.step()[0]
    return opt


def test_state_of_local_shards_holding_several_blocks_reshards_to_whole_params(tmp_path) -> None:
    """Optimized tensors that are flat local shards, each holding blocks of several params (FSDP2's
    layout: each model ShardedTensor a view into a shard), save their state cut into those blocks; the
    plain optimizer over whole params loads it and holds the plain run's moments (up to the last bit:
    vectorised kernels round tensors of other lengths differently)."""
    torch.manual_seed(0)
    full = [torch.randn(4, 6), torch.randn(3, 5)]
    grads = [[torch.randn_like(w) for w in full] for _ in range(2)]
    plain = _adam_after_steps([torch.nn.Parameter(w.clone()) for w in full], grads)
    # (param, flat start, flat stop) of each shard's pieces: rows 1..3 of w0 and w1[2:11]; the rest.
    layout = [[(0, 6, 24), (1, 2, 11)], [(0, 0, 6), (1, 0, 2), (1, 11, 15)]]

    def cut(tensors: list[torch.Tensor], pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        return torch.cat([tensors[i].reshape(-1)[a:b] for i, a, b in pieces])

    shards = [torch.nn.Parameter(cut(full, pieces)) for pieces in layout]
    shard_grads = [[cut(g, pieces) for pieces in layout] for g in grads]
    sharded = _adam_after_steps(shards, shard_grads)
    whole = [ShardedTensor(f"w{i}", w, tuple(w.shape), (0, 0)) for i, w in enumerate(full)]
    model_sd: dict = {}
    for s, (shard, pieces) in enumerate(zip(shards, layout)):
        offset = 0
        for i, a, b in pieces:
            view = shard.data[offset : offset + b - a]
            model_sd[f"{s}.{i}.{a}"] = flat_range_blocks(whole[i], view, a, b)
            offset += b - a
    sd = sharded.sharded_state_dict(model_sd)
    # w0: rows 1..3, then row 0; w1 (rows of 5): [2, 5) [5, 10) [10, 11), then [0, 2) and [11, 15).
    assert set(sd["param_state"]) == {"w0", "w0#1", "w1", "w1#1", "w1#2", "w1#3", "w1#4"}
    dist_checkpointing.save({"optimizer": sd}, str(tmp_path))
    fresh = MegatronOptimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1),
        [{"params": [torch.nn.Parameter(torch.zeros_like(w)) for w in full], "name": "decay"}],
    )
    fresh_sd = {
        f"p{i}": ShardedTensor(f"w{i}", p, tuple(p.shape), (0, 0)) for i, p in enumerate(fresh.model_params)
    }
    request = {"optimizer": fresh.sharded_state_dict(fresh_sd)}
    fresh.load_sharded_state_dict(dist_checkpointing.load(request, str(tmp_path))["optimizer"])
    for kind in ("exp_avg", "exp_avg_sq"):
        for got, ref in zip(fresh.main_params, plain.main_params):
            assert_close(
                fresh.optimizer.state[got][kind], plain.optimizer.state[ref][kind], rtol=1e-6, atol=0
            )


# ---------------------------------------------------------------------------------------------- runs
VOCAB, SEQ, MICRO, GLOBAL = 64, 16, 2, 8  # GLOBAL samples per step over MICRO micro-batches


def _gpt(ps: ParallelState, bf16: bool = False, tied: bool = True) -> DistributedDataParallel | GPTModel:
    stage = {}
    if ps.pp_size > 1:
        stage = dict(
            pre_process=ps.pp_rank == 0,
            post_process=ps.pp_rank == ps.pp_size - 1,
            num_layers=2 // ps.pp_size,
            layer_offset=ps.pp_rank * (2 // ps.pp_size),
        )
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        share_embeddings_and_output_weights=tied,
        cross_entropy_loss_fusion=not tied,  # untied: the output layer's weight read by the fused loss
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
        sequence_parallel=ps.tp_size > 1,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_state=ps,
        device=device(),
        seed=7,
        **stage,
    )


def _step_batches(step: int, ps: ParallelState) -> list[torch.Tensor]:
    """This data-parallel rank's micro-batches of step ``step`` (the same global batch for every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randint(0, VOCAB, (MICRO, GLOBAL // MICRO, SEQ), generator=g)
    mbs = GLOBAL // MICRO // ps.dp_size
    return [full[m, ps.dp_rank * mbs : (ps.dp_rank + 1) * mbs].to(device()) for m in range(MICRO)]


def _forward_step(data_iterator, model):
    ids = next(data_iterator)
    out = model(ids, None, None, labels=ids)
    return out, lambda y: (y.float().mean(), {"lm loss": y.detach().float().mean()})


def _build(ps: ParallelState, distopt: bool, overlap: bool = False, bf16: bool = False, tied: bool = True):
    module = _gpt(ps, bf16, tied)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distopt,
        bucket_size=2000,
    )
    model = DistributedDataParallel(module.config, ddp_config, module, ps)
    module.config.no_sync_func = model.no_sync
    module.config.finalize_model_grads_func = None
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5, bf16=bf16),
        [model],
        grad_stats_group=ps.mp_group,
        tp_rank=ps.tp_rank,
    )
    return model, opt


def _train(model, opt, ps: ParallelState, steps: range) -> list[tuple[float, float]]:
    """(loss of the global batch on the last stage, else 0; grad norm) of each step."""
    schedule = get_forward_backward_func(ps.pp_size, 1)
    out = []
    for step in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        metrics = schedule(
            forward_step_func=_forward_step,
            data_iterator=iter(_step_batches(step, ps)),
            model=[model],
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=GLOBAL // MICRO // ps.dp_size,
        )
        finalize_model_grads([model])
        ok, grad_norm, _ = opt.step()
        assert ok
        loss = sum(m["lm loss"] for m in metrics) / MICRO if metrics else torch.zeros((), device=device())
        dist.all_reduce(loss, group=ps.dp_group)  # the global batch's loss
        out.append((float(loss) / ps.dp_size, grad_norm))
    opt.finish_param_sync()
    return out


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])


def _matches_plain(ps: ParallelState, bf16: bool, overlaps: tuple[bool, ...] = (False, True)) -> None:
    """10 steps of the plain optimizer, then of the distributed one (without and with overlapped
    reduce-scatter and all-gather): the same losses, grad norms and weights, on every replica."""
    model, opt = _build(ps, distopt=False, bf16=bf16)
    ref_curve, ref_weights = _train(model, opt, ps, range(10)), _weights(model)
    # bf16: one rounding of a weight to bf16 differently moves the later steps slightly.
    loss_rtol, norm_rtol = (2e-4, 5e-3) if bf16 else (1e-5, 1e-5)
    for overlap in overlaps:
        model, opt = _build(ps, distopt=True, overlap=overlap, bf16=bf16)
        assert isinstance(opt, DistributedOptimizer)
        curve, weights = _train(model, opt, ps, range(10)), _weights(model)
        for (loss, norm), (ref_loss, ref_norm) in zip(curve, ref_curve):
            assert loss == pytest.approx(ref_loss, rel=loss_rtol, abs=1e-6), overlap
            assert norm == pytest.approx(ref_norm, rel=norm_rtol), overlap
        # (the clipping factor differs in its last bits: the norm sums per piece, not per param)
        assert_close(weights, ref_weights, rtol=1e-2 if bf16 else 1e-5, atol=1e-2 if bf16 else 1e-5)
        gathered = [torch.empty_like(weights) for _ in range(ps.dp_size)]
        dist.all_gather(gathered, weights, group=ps.dp_group)
        assert all(torch.equal(g, gathered[0]) for g in gathered)  # every replica holds the same weights


@distributed_test(world_size=2)
def test_matches_the_plain_optimizer_dp2(ps: ParallelState) -> None:
    _matches_plain(ps, bf16=False)


@distributed_test(world_size=2)
def test_an_overlapped_gather_ends_before_the_fused_loss_reads_the_output_layer(ps: ParallelState) -> None:
    """The fused output-layer loss reads the untied output layer's weight without calling the layer (its
    forward pre-hook never runs): with --overlap-param-gather, that bucket's gather must have been
    waited for by then, every step, and the curve is the plain optimizer's."""
    model, opt = _build(ps, distopt=False, tied=False)
    ref = _train(model, opt, ps, range(4))
    model, opt = _build(ps, distopt=True, overlap=True, tied=False)
    gpt = model.module
    assert gpt.fused_cross_entropy
    gather = opt.param_sync
    bucket = gather.bucket_of[id(gpt.output_layer.weight)]
    in_flight: list[bool] = []
    loss = gpt.output_loss

    def spy(*args, **kwargs):
        in_flight.append(bucket in gather.pending)
        return loss(*args, **kwargs)

    gpt.output_loss = spy
    curve = _train(model, opt, ps, range(4))
    assert len(in_flight) == 4 * MICRO and not any(in_flight)
    for (got, norm), (want, ref_norm) in zip(curve, ref):
        assert got == pytest.approx(want, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)


@distributed_test(world_size=2)
def test_matches_the_plain_bf16_optimizer_dp2(ps: ParallelState) -> None:
    """bf16 params with fp32 main params and gradient reduction, against the plain bf16 path."""
    _matches_plain(ps, bf16=True, overlaps=(True,))


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["dp4", "tp2xdp2-sp", "pp2xdp2"])
@distributed_test(world_size=4, tp="tp", pp="pp")
def test_matches_the_plain_optimizer_on_four_ranks(ps: ParallelState, tp: int, pp: int) -> None:
    """dp4, tp2 x dp2 (sequence parallel) and pp2 x dp2 (the tied embedding across the stages)."""
    _matches_plain(ps, bf16=False)


# ---------------------------------------------------------------------------------------------- checkpoints
def _state_in_param_space(opt: MegatronOptimizer, model: DistributedDataParallel, ps: ParallelState) -> dict:
    """``{(param name, kind): flat fp32 array}`` of the whole optimizer state, whichever layout holds it."""
    if isinstance(opt, DistributedOptimizer):
        where = {id(pc.param): [] for pc in opt.pieces}
        for pc, main in zip(opt.pieces, opt.main_params):
            where[id(pc.param)].append((pc.start, pc.stop, main))
    else:
        where = {id(p): [(0, p.numel(), m)] for p, m in zip(opt.model_params, opt.main_params)}
    out = {}
    for name, p in model.module.named_parameters():
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            full = torch.zeros(p.numel(), device=device())
            for start, stop, main in where.get(id(p), []):
                value = main if kind == "fp32_param" else opt.optimizer.state[main][kind]
                full[start:stop] = value.detach().reshape(-1)
            if isinstance(opt, DistributedOptimizer):
                dist.all_reduce(full, group=ps.dp_group)
            out[name, kind] = full.cpu().numpy()  # (a tensor would cross to pytest as a shared-memory handle)
    return out


def _save_body(ps: ParallelState, ckpt: str, distopt: bool, bf16: bool) -> dict:
    model, opt = _build(ps, distopt, overlap=True, bf16=bf16)
    _train(model, opt, ps, range(3))
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, ckpt)
    return _state_in_param_space(opt, model, ps)


def _resume_body(ps: ParallelState, ckpt: str, distopt: bool, bf16: bool) -> tuple[dict, list]:
    model, opt = _build(ps, distopt, overlap=True, bf16=bf16)
    model_sd = model.sharded_state_dict()
    request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
    opt.load_sharded_state_dict(dist_checkpointing.load(request, ckpt)["optimizer"])
    return _state_in_param_space(opt, model, ps), _train(model, opt, ps, range(3, 6))


def _straight_body(ps: ParallelState, bf16: bool) -> list:
    model, opt = _build(ps, distopt=False, bf16=bf16)
    return _train(model, opt, ps, range(6))


@pytest.mark.parametrize(
    "save, load, bf16",
    [
        ((2, True), (1, False), True),
        ((1, False), (2, True), True),
        ((2, True), (4, True), False),
        ((4, True), (2, True), False),
    ],
    ids=["distopt-dp2-to-plain-dp1", "plain-dp1-to-distopt-dp2", "dp2-to-dp4", "dp4-to-dp2"],
)
def test_checkpoints_reshard_between_optimizers_and_data_parallel_sizes(tmp_path, save, load, bf16) -> None:
    """Saved after 3 steps under one layout, loaded under another: every element of the fp32 main
    params and Adam moments arrives where the saving layout held it (bitwise), and training continues
    on the uninterrupted one-process curve."""
    ckpt = str(tmp_path / "ck")
    saved = run_distributed(_save_body, save[0], kwargs=dict(ckpt=ckpt, distopt=save[1], bf16=bf16))[0]
    loaded, resumed = run_distributed(
        _resume_body, load[0], kwargs=dict(ckpt=ckpt, distopt=load[1], bf16=bf16)
    )[-1]
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        if key[1] != "fp32_param" or bf16:
            assert (loaded[key] == value).all(), key
    straight = run_distributed(_straight_body, 1, kwargs=dict(bf16=bf16))[0]
    rtol = 1e-2 if bf16 else 1e-5
    for (loss, norm), (ref_loss, ref_norm) in zip(resumed, straight[3:]):
        assert loss == pytest.approx(ref_loss, rel=rtol) and norm == pytest.approx(ref_norm, rel=rtol)


@distributed_test(world_size=4)
def test_optimizer_state_per_rank_falls_by_the_data_parallel_size(ps: ParallelState) -> None:
    """dp4, bf16 params: each rank holds 12 bytes (fp32 main param and two moments) per element of
    its quarter of every bucket; the ranks' states add up to the plain optimizer's exactly, so each
    differs from a quarter of it by at most the padding, and the start-up line says both figures."""
    model, opt = _build(ps, distopt=True, bf16=True)
    mine = sum(t.numel() for t in opt.model_params) * 12
    plain = sum(p.numel() for p in model.module.parameters()) * 12
    padding = sum(b.numel for b in model.buckets) * 12 - plain
    total = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(total)
    assert int(total) == plain and abs(mine - plain / 4) <= padding
    assert padding < plain / 4  # the layout pads little: the drop is about 4-fold
    line = memory_report(opt, [model])
    assert f"holds {mine / 2**20:.2f} MiB" in line and f"would hold {plain / 2**20:.2f} MiB" in line
    assert "owns 1/4 of every gradient bucket" in line
