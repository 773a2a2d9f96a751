"""Flat element ranges of a local shard as rectangular checkpoint blocks."""

import itertools

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.flat_ranges import flat_range_blocks, flat_range_rects
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.state_tree import strip_sharded


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_rectangles_cover_exactly_the_range_in_order(shape):
    n = torch.Size(shape).numel()
    for start, stop in itertools.combinations(range(n + 1), 2):
        rects = flat_range_rects(shape, start, stop)
        assert len(rects) <= 2 * len(shape) - 1
        covered = []
        for off, size, flat in rects:
            index = torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(off, size))]
            assert index.reshape(-1).tolist() == list(range(flat, flat + index.numel()))  # contiguous
            covered += index.reshape(-1).tolist()
        assert covered == list(range(start, stop))


def test_blocks_of_ranks_save_as_one_tensor_and_reshard_on_load(tmp_path):
    """Three ranges of a column-sharded (tp rank 1 of 2) weight, saved as blocks, load back as the
    whole global tensor's columns: what a flat-sharded optimizer state must do."""
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    local = full[:, 4:].contiguous()  # tp rank 1 of a column split
    st = ShardedTensor.from_rank_offsets("w", local, (1, 1, 2))
    flat = local.reshape(-1)
    blocks = []
    for start, stop in ((0, 5), (5, 17), (17, 24)):
        blocks += flat_range_blocks(
            st, flat[start:stop].clone(), start, stop, key="optimizer.state.exp_avg.w"
        )
    left = ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.w", full[:, :4].contiguous(), (1, 0, 2))
    dist_checkpointing.save({"a": blocks, "b": left}, str(tmp_path))
    target = ShardedTensor("optimizer.state.exp_avg.w", torch.zeros(6, 8), (6, 8), (0, 0))
    loaded = dist_checkpointing.load({"x": target}, str(tmp_path))
    torch.testing.assert_close(loaded["x"], full, rtol=0, atol=0)


def test_a_flat_range_loads_from_an_unsharded_save(tmp_path):
    full = torch.randn(5, 6)
    dist_checkpointing.save({"w": ShardedTensor("w", full, (5, 6), (0, 0))}, str(tmp_path))
    st = ShardedTensor("w", torch.zeros(5, 6), (5, 6), (0, 0))
    shard = torch.zeros(13)
    loaded = dist_checkpointing.load({"w": flat_range_blocks(st, shard, 8, 21)}, str(tmp_path))
    got = torch.cat([b.reshape(-1) for b in loaded["w"]])
    torch.testing.assert_close(got, full.reshape(-1)[8:21], rtol=0, atol=0)


def test_ranks_holding_different_blocks_have_the_same_common_part():
    """A flat-sharded optimizer state names, on each rank, only the params it holds blocks of; the
    plain part saved once by rank 0 (and compared across ranks) must not depend on which."""
    st = ShardedTensor("w", torch.zeros(4, 3), (4, 3), (0, 0))
    common = ShardedObject("optimizer.common", {"step": 3}, replica_id=0)
    rank0 = {"param_state": {"w": {"exp_avg": flat_range_blocks(st, torch.zeros(5), 0, 5)}}, "common": common}
    rank1 = {
        "param_state": {"v": {"exp_avg": flat_range_blocks(st, torch.zeros(7), 5, 12)}},
        "common": common,
    }
    assert (
        strip_sharded({"optimizer": rank0, "x": 1}) == strip_sharded({"optimizer": rank1, "x": 1}) == {"x": 1}
    )
    assert strip_sharded({"a": {}, "b": [1, st]}) == {"a": {}, "b": [1, None]}  # plain values stay
