"""Every process group waits the configured timeout for a collective, not torch's default (30 min
for gloo): ``dist.new_group`` without a timeout ignores ``init_process_group``'s."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import device, distributed_test, run_distributed

from megatron.core.parallel_state import ParallelState, build_parallel_state, default_group_timeout


def _timeout_of(group) -> timedelta:
    backend = group._get_backend(device())  # a private attribute, read by this test only
    return backend.options._timeout


@distributed_test(world_size=2, timeout_s=45.0)
def test_every_group_waits_as_long_as_the_default_group(ps: ParallelState) -> None:
    """The harness's ``initialize_model_parallel()`` passes no timeout: its groups take the 45 s
    the default group was made with."""
    if default_group_timeout() is None:
        pytest.skip("this torch does not expose a group's timeout")
    assert default_group_timeout() == timedelta(seconds=45)
    for name, group in ps.groups.items():
        assert _timeout_of(group) == timedelta(seconds=45), name


def _late_peer(ps: ParallelState) -> float | None:
    state = build_parallel_state(timeout=timedelta(seconds=2))
    if default_group_timeout() is not None:
        assert {name: _timeout_of(g) for name, g in state.groups.items()} == dict.fromkeys(
            state.groups, timedelta(seconds=2)
        )
    if dist.get_rank() == 1:
        time.sleep(8)  # never joins: rank 0's collective must give up after 2 s, not 30 min
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1), group=state.groups["dp"])
    return time.monotonic() - start


def test_a_collective_on_a_group_times_out_after_the_configured_timeout() -> None:
    waited, _ = run_distributed(_late_peer, world_size=2, backend="gloo", timeout_s=60.0)
    assert 1.5 < waited < 6.0, waited
