"""RNG tracker: named states, tp-rank-specific masks, and checkpoint recompute replaying them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import device, distributed_test
from torch import nn

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_seed,
)
from megatron.core.tensor_parallel.random import (
    checkpoint_with_rng as checkpoint,
)


def test_fork_draws_from_the_named_state_and_leaves_the_default_alone() -> None:
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 7)
    torch.manual_seed(0)
    expected_default = torch.rand(5)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(5)
    assert torch.equal(torch.rand(5), expected_default)  # default stream unaffected
    assert torch.equal(first, torch.rand(5, generator=torch.Generator().manual_seed(7)))
    with tracker.fork("a"):
        second = torch.rand(5)  # continues the named stream
    gen = torch.Generator().manual_seed(7)
    gen_first = torch.rand(5, generator=gen)
    assert torch.equal(first, gen_first) and torch.equal(second, torch.rand(5, generator=gen))


def test_states_round_trip_for_checkpoints() -> None:
    tracker = model_parallel_seed(123, tp_rank=1, device="cpu")
    assert tracker.names() == ["model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"]
    saved = tracker.get_states()
    with tracker.fork():
        a = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        b = torch.rand(4)
    assert torch.equal(a, b)
    # Megatron's seeds: model-parallel = seed + 2718 + tp_rank, data-parallel = seed.
    assert torch.equal(saved[MODEL_PARALLEL_RNG], torch.Generator().manual_seed(123 + 2718 + 1).get_state())
    assert torch.equal(saved["data-parallel-rng"], torch.Generator().manual_seed(123).get_state())


def test_errors() -> None:
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 .* already used by 'a'"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("missing"):
            pass


class _Block(nn.Module):
    """Linear -> tracker-forked dropout (a tp region) -> Linear -> default-RNG dropout."""

    def __init__(self, tracker: RNGStatesTracker):
        super().__init__()
        self.tracker = tracker
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        with self.tracker.fork():
            h = F.dropout(h, p=0.5, training=True)
        return F.dropout(torch.tanh(self.fc2(h)), p=0.3, training=True)


def _train_step(recompute: bool, replay_tracker: bool = True) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    tracker = model_parallel_seed(42, tp_rank=0, device="cpu")
    block = _Block(tracker)
    x = torch.randn(4, 8, requires_grad=True)
    outs = []
    for _ in range(2):  # two steps: the tracker must have advanced identically after the first
        out = checkpoint(block, x, tracker=tracker if replay_tracker else None) if recompute else block(x)
        (out * torch.arange(8.0)).sum().backward()
        outs.append(out.detach())
    return (
        *outs,
        x.grad,
        block.fc1.weight.grad,
        block.fc2.weight.grad,
        tracker.get_states()[MODEL_PARALLEL_RNG],
        torch.get_rng_state(),
    )


def test_checkpoint_recompute_is_bitwise_identical() -> None:
    plain, ckpt = _train_step(recompute=False), _train_step(recompute=True)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
    # Without replaying the tracker the recompute draws other masks: the test above has teeth.
    broken = _train_step(recompute=True, replay_tracker=False)
    assert not torch.equal(plain[2], broken[2])


@distributed_test(world_size=2, tp=2)
def test_masks_differ_across_tp_only_inside_tp_regions(ps: ParallelState) -> None:
    torch.manual_seed(1234)  # the default seed is the same on every tp rank
    tracker = model_parallel_seed(1234, ps.tp_rank, device=device())
    ones = torch.ones(64, device=device())
    replicated = F.dropout(ones, p=0.5)
    with tracker.fork():
        sharded = F.dropout(ones, p=0.5)
    both = [torch.empty_like(ones) for _ in range(2)]
    dist.all_gather(both, replicated, group=ps.tp_group)
    assert torch.equal(both[0], both[1])
    dist.all_gather(both, sharded, group=ps.tp_group)
    assert not torch.equal(both[0], both[1])
