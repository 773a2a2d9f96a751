"""broadcast_data: tp rank 0 sends a micro-batch of known shapes to the other tp ranks."""

from __future__ import annotations

import pytest
import torch
from harness import device, distributed_test

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.data import broadcast_data

B, S = 2, 6
SPECS = {
    "tokens": ((B, S), torch.int64),
    "labels": ((B, S), torch.int64),
    "loss_mask": ((B, S), torch.float32),
    "attention_mask": ((B, 1, S, S), torch.bool),
    "position_ids": ((B, S), torch.int64),
}
KEYS = list(SPECS)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (B, S + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.rand(B, S, generator=gen).round(),
        "attention_mask": torch.rand(B, 1, S, S, generator=gen) > 0.5,
        "position_ids": torch.arange(S).repeat(B, 1),
    }


@distributed_test(world_size=4, tp=2)
def test_broadcast_within_each_tp_group(ps: ParallelState) -> None:
    expected = _batch(seed=ps.dp_rank)  # each data-parallel replica has its own batch
    data = expected if ps.tp_rank == 0 else None
    got = broadcast_data(KEYS, data, SPECS, ps.tp_group, src_rank=ps.group_ranks["tp"][0], device=device())
    assert list(got) == KEYS
    for key in KEYS:
        assert got[key].dtype == SPECS[key][1] and got[key].device == device()
        assert torch.equal(got[key].cpu(), expected[key]), key


def test_single_rank_is_a_copy_and_checks_the_batch() -> None:
    batch = _batch(seed=0)
    got = broadcast_data(KEYS, batch, SPECS, None, src_rank=0)
    assert all(torch.equal(got[k], batch[k]) for k in KEYS)
    with pytest.raises(ValueError, match=r"'labels' is \(2, 5\) torch.int64, expected \(2, 6\) torch.int64"):
        broadcast_data(KEYS, {**batch, "labels": batch["labels"][:, :5]}, SPECS, None, src_rank=0)
    with pytest.raises(ValueError, match="key 'tokens' is missing"):
        broadcast_data(KEYS, {k: v for k, v in batch.items() if k != "tokens"}, SPECS, None, src_rank=0)
