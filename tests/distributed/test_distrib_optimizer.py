"""The bucket-sharded distributed optimizer (Megatron's layout) and layout-independent optimizer checkpoints."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.flat_ranges import flat_range_blocks
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer


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
