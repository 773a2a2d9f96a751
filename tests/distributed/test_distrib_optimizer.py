"""The bucket-sharded distributed optimizer (Megatron's layout) and layout-independent optimizer checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import device, distributed_test
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


def _gpt(ps: ParallelState, bf16: bool = False) -> DistributedDataParallel | GPTModel:
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
        share_embeddings_and_output_weights=True,
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


def _build(ps: ParallelState, distopt: bool, overlap: bool = False, bf16: bool = False):
    module = _gpt(ps, bf16)
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
    """(loss on the last stage else 0, grad norm) of each step."""
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
        loss = float(sum(m["lm loss"] for m in metrics) / MICRO) if metrics else 0.0
        out.append((loss, grad_norm))
    opt.finish_param_sync()
    return out


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])


def _matches_plain(ps: ParallelState, overlap: bool, bf16: bool) -> None:
    curves, weights = {}, {}
    for distopt in (False, True):
        model, opt = _build(ps, distopt, overlap, bf16)
        assert isinstance(opt, DistributedOptimizer) == distopt
        curves[distopt] = _train(model, opt, ps, range(10))
        weights[distopt] = _weights(model)
    rtol = 2e-2 if bf16 else 1e-5
    for (loss, norm), (ref_loss, ref_norm) in zip(curves[True], curves[False]):
        assert loss == pytest.approx(ref_loss, rel=rtol, abs=1e-6)
        assert norm == pytest.approx(ref_norm, rel=rtol)
    # (the clipping factor differs in its last bits: the norm sums per piece, not per param)
    assert_close(weights[True], weights[False], rtol=rtol, atol=1e-2 if bf16 else 1e-5)
    # Every data-parallel replica holds the same weights.
    gathered = [torch.empty_like(weights[True]) for _ in range(ps.dp_size)]
    dist.all_gather(gathered, weights[True], group=ps.dp_group)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.parametrize("overlap", [False, True])
@distributed_test(world_size=2)
def test_matches_the_plain_optimizer_dp2(ps: ParallelState, overlap: bool) -> None:
    _matches_plain(ps, overlap, bf16=False)


@distributed_test(world_size=2)
def test_matches_the_plain_optimizer_dp2_bf16(ps: ParallelState) -> None:
    _matches_plain(ps, overlap=True, bf16=True)


@pytest.mark.parametrize(
    "tp, pp, overlap", [(1, 1, True), (2, 1, False), (2, 1, True), (1, 2, False), (1, 2, True)]
)
@distributed_test(world_size=4, tp="tp", pp="pp")
def test_matches_the_plain_optimizer_on_four_ranks(
    ps: ParallelState, tp: int, pp: int, overlap: bool
) -> None:
    """dp4, tp2 x dp2 (sequence parallel) and pp2 x dp2 (tied embedding across the stages)."""
    _matches_plain(ps, overlap, bf16=False)
