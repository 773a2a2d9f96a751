"""Ownership of parameters under the distributed optimizer."""

import pytest
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.distributed.param_owners import assign_owners
from megatron.training.user_errors import flag_message


def _params(*sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_balanced_deterministic_and_pinned():
    params = _params(100, 10, 60, 40, 30, 30, 5, 5)
    owners = assign_owners(params, 2)
    assert owners == assign_owners(params, 2)  # the same on every rank
    load = [sum(p.numel() for p in params if owners[id(p)] == r) for r in range(2)]
    assert sorted(load) == [140, 140]
    pinned = assign_owners(params, 3, pinned=(params[6],))  # a small tied embedding: rank 0 regardless
    assert pinned[id(params[6])] == 0
    assert set(pinned.values()) == {0, 1, 2}


def test_too_few_params_names_the_flag():
    # The library names the parameter; the application rewrites it to --use-distributed-optimizer.
    with pytest.raises(ConfigError, match="use_distributed_optimizer needs at least one parameter") as e:
        assign_owners(_params(4, 4), 4)
    assert e.value.params == ("use_distributed_optimizer",)
    assert "turn --use-distributed-optimizer off" in flag_message(e.value)
