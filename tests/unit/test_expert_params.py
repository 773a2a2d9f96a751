"""Expert parameters (stacked local experts, tagged by moe.expert_params): the initialisation is the
same under every expert layout (ep, etp, strided SwiGLU halves), rows of a shard generated on their
own equal the whole shard's, checkpoints describe them as blocks of the global [E, ...] tensor, and
the gradient statistics count them once."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer.clip_grads import counts_in_stats, param_is_not_duplicate
from megatron.core.tensor_parallel.init import init_param_, init_param_rows_, set_init_attrs
from megatron.core.transformer.module import shard_of
from megatron.core.transformer.moe.expert_params import is_expert_param, tag_expert_param

E, H, F = 4, 6, 10  # experts, hidden, expert FFN
NAME = "decoder.layers.1.mlp.experts.linear_fc1.weight"

# (partition_dim of the stacked tensor, stride, per-expert logical shape): fc1 [2F, h] with its
# [gate; up] halves split separately, fc2 [h, F] split along columns, a bias unsplit.
KINDS = {"fc1": (1, 2, (2 * F, H)), "fc2": (2, 1, (H, F)), "bias": (-1, 1, (H,))}


def _param(kind: str, ep: int, ep_rank: int, etp: int, etp_rank: int, device: str = "cpu") -> torch.Tensor:
    dim, stride, shape = KINDS[kind]
    local = list(shape)
    if dim >= 1:
        local[dim - 1] //= etp
    param = torch.empty((E // ep, *local), device=device)
    return tag_expert_param(
        param,
        num_experts=E,
        ep_rank=ep_rank,
        ep_size=ep,
        etp_rank=etp_rank,
        init_std=0.02,
        partition_dim=dim,
        partition_size=etp if dim >= 1 else 1,
        partition_stride=stride,
    )


def _logical(kind: str) -> torch.Tensor:
    """The global [E, ...] tensor: ep1, etp1."""
    full = _param(kind, 1, 0, 1, 0)
    init_param_(full, NAME, seed=5)
    return full


def _expected_shard(kind: str, ep: int, ep_rank: int, etp: int, etp_rank: int) -> torch.Tensor:
    dim, stride, _ = KINDS[kind]
    full = _logical(kind)[ep_rank * (E // ep) : (ep_rank + 1) * (E // ep)]
    if dim < 1 or etp == 1:
        return full
    halves = full.chunk(stride, dim=dim)  # each stacked sub-tensor split on its own
    return torch.cat([h.chunk(etp, dim=dim)[etp_rank] for h in halves], dim=dim)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_init_is_the_shard_of_the_global_experts_under_every_layout(kind: str, ep: int, etp: int) -> None:
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            param = _param(kind, ep, ep_rank, etp, etp_rank)
            init_param_(param, NAME, seed=5, tp_rank=7)  # the dense tp rank is not read
            assert torch.equal(param, _expected_shard(kind, ep, ep_rank, etp, etp_rank)), (ep_rank, etp_rank)


def test_each_expert_is_its_own_logical_tensor() -> None:
    """Expert i of the stack is the dense tensor named f"{name}.{i}" (so the experts differ, and the
    number of experts changes none of them)."""
    full = _logical("fc2")
    for i in range(E):
        dense = set_init_attrs(torch.empty(H, F), std=0.02)
        init_param_(dense, f"{NAME}.{i}", seed=5)
        assert torch.equal(full[i], dense), i
    assert not torch.equal(full[0], full[1])


@pytest.mark.parametrize("kind", ["fc1", "fc2"])
def test_rows_of_a_shard_generated_alone_equal_the_whole_shard(kind: str) -> None:
    """init_param_rows_ (meta init, FSDP2 dim-0 shards) over a range of local experts."""
    whole = _param(kind, 1, 0, 2, 1)
    init_param_(whole, NAME, seed=5)
    meta = _param(kind, 1, 0, 2, 1, device="meta")
    for start, stop in [(0, 1), (1, 3), (3, 4), (2, 2), (0, 4)]:
        dest = torch.full((stop - start, *whole.shape[1:]), float("nan"))
        init_param_rows_(dest, meta, NAME, 5, 0, start, stop)
        assert torch.equal(dest, whole[start:stop]), (start, stop)


def test_constant_expert_params_take_their_value() -> None:
    bias = tag_expert_param(
        torch.empty(2, H), num_experts=4, ep_rank=1, ep_size=2, etp_rank=0, init_value=1.5
    )
    init_param_(bias, NAME, seed=5)
    assert torch.equal(bias, torch.full((2, H), 1.5))


@pytest.mark.parametrize("ep, etp", [(2, 1), (2, 2), (4, 2)])
def test_sharded_tensor_is_the_block_of_the_global_expert_tensor(ep: int, etp: int) -> None:
    """dim 0 block ep_rank (offset expert_offset), the split dim block etp_rank, [gate; up] stored as
    [E, 2, F, h] whatever etp, replicated over expert-dp only (and over etp where not split)."""
    for kind in KINDS:
        dim, stride, shape = KINDS[kind]
        for ep_rank in range(ep):
            for etp_rank in range(etp):
                param = _param(kind, ep, ep_rank, etp, etp_rank)
                init_param_(param, NAME, seed=5)
                st = shard_of("k", param, tp_rank=5, dp_rank=6, expt_dp_rank=3)
                logical = _logical(kind)
                if stride > 1:
                    logical = logical.view(E, stride, shape[0] // stride, *shape[1:])
                assert st.global_shape == tuple(logical.shape)
                block = logical[tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))]
                assert torch.equal(st.data.reshape(block.shape), block), (kind, ep_rank, etp_rank)
                assert st.global_offset[0] == ep_rank * (E // ep)
                split = dim >= 1 and etp > 1
                assert st.replica_id == (0 if split else etp_rank, 3)
                assert st.data.data_ptr() == param.data_ptr()  # a view: loading fills the param


def test_dense_params_keep_their_sharding() -> None:
    dense = torch.empty(8, 4)
    st = shard_of("w", dense, tp_rank=1, dp_rank=2, expt_dp_rank=9)
    assert st.replica_id == (1, 2) and st.global_shape == (8, 4)


def test_statistics_count_each_expert_shard_once() -> None:
    """Expert shards differ along etp x ep: counted on every tp rank (the dense tp rank is not read),
    unsplit ones on expert-tp rank 0 only, and each on its first expert-dp replica."""
    split = _param("fc2", 2, 1, 2, 1)
    unsplit = _param("bias", 2, 1, 2, 1)
    assert is_expert_param(split) and not is_expert_param(torch.empty(1))
    assert param_is_not_duplicate(split, tp_rank=1) and not param_is_not_duplicate(unsplit, tp_rank=0)
    assert param_is_not_duplicate(_param("bias", 2, 1, 2, 0), tp_rank=1)
    assert counts_in_stats(split, 1, (3, 0)) and not counts_in_stats(split, 1, (0, 1))
    dense = torch.empty(3)
    assert counts_in_stats(dense, 0, (0, 5)) and not counts_in_stats(dense, 0, (1, 0))
