"""Megatron-Core's tensor_parallel functions called without a group after
``initialize_model_parallel(tp)`` (the harness calls it) act on the default tp group, as in
Megatron-Core: each is checked against the single-process math of the full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import device, distributed_test
from torch.testing import assert_close

from megatron.core import tensor_parallel as tpl
from megatron.core.parallel_state import ParallelState
from tests.distributed.test_mappings import _run


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device())


@pytest.mark.parametrize("tp", [2, 4])
@distributed_test(world_size="tp", tp="tp")
def test_cross_entropy_without_a_group_is_the_full_vocabulary_loss(ps: ParallelState, tp: int) -> None:
    logits, target = (
        _full(0, 3, 2, 16),
        torch.randint(0, 16, (3, 2), generator=torch.Generator().manual_seed(1)),
    )
    target = target.to(device())
    for smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_(True)
        want = F.cross_entropy(
            full.reshape(-1, 16), target.reshape(-1), reduction="none", label_smoothing=smoothing
        ).view(3, 2)
        want.sum().backward()
        shard = logits.chunk(tp, -1)[ps.tp_rank].clone().requires_grad_(True)
        got = tpl.vocab_parallel_cross_entropy(shard, target, smoothing)
        got.sum().backward()
        assert_close(got, want)
        assert_close(shard.grad, full.grad.chunk(tp, -1)[ps.tp_rank])


@distributed_test(world_size=2, tp=2)
def test_mappings_without_a_group_use_the_default_tp_group(ps: ParallelState) -> None:
    r, tp = ps.tp_rank, 2
    x, grad = _full(2, 4, 2, 6), _full(3, 4, 2, 6)
    y, dx = _run(tpl.copy_to_tensor_model_parallel_region, x, grad * (r + 1))
    assert_close(y, x)
    assert_close(dx, grad * 3)
    y, dx = _run(tpl.reduce_from_tensor_model_parallel_region, x * (r + 1), grad)
    assert_close(y, x * 3)
    assert_close(dx, grad)
    y, dx = _run(tpl.scatter_to_tensor_model_parallel_region, x, grad.chunk(tp, -1)[r])
    assert_close(y, x.chunk(tp, -1)[r])
    assert_close(dx, grad)
    y, dx = _run(tpl.gather_from_tensor_model_parallel_region, x.chunk(tp, -1)[r], grad)
    assert_close(y, x)
    assert_close(dx, grad.chunk(tp, -1)[r])
    y, dx = _run(tpl.scatter_to_sequence_parallel_region, x, grad.chunk(tp, 0)[r])
    assert_close(y, x.chunk(tp, 0)[r])
    assert_close(dx, grad)
    y, dx = _run(tpl.gather_from_sequence_parallel_region, x.chunk(tp, 0)[r], grad * (r + 1))
    assert_close(y, x)
    assert_close(dx, (grad * 3).chunk(tp, 0)[r])  # backward: reduce-scatter
    y, dx = _run(lambda t: tpl.gather_from_sequence_parallel_region(t, False), x.chunk(tp, 0)[r], grad)
    assert_close(dx, grad.chunk(tp, 0)[r])  # backward: this rank's block
    y, dx = _run(tpl.reduce_scatter_to_sequence_parallel_region, x * (r + 1), grad.chunk(tp, 0)[r])
    assert_close(y, (x * 3).chunk(tp, 0)[r])
    assert_close(dx, grad)
    y, dx = _run(tpl.all_gather_last_dim_from_tensor_parallel_region, x.chunk(tp, -1)[r], grad * (r + 1))
    assert_close(y, x)
    assert_close(dx, (grad * 3).chunk(tp, -1)[r])
    y, dx = _run(tpl.reduce_scatter_last_dim_to_tensor_parallel_region, x * (r + 1), grad.chunk(tp, -1)[r])
    assert_close(y, (x * 3).chunk(tp, -1)[r])
    assert_close(dx, grad)
    # all_to_all: block j of rank i's input lands as block i on rank j.
    blocks = torch.arange(4.0, device=device()).view(4, 1) + 10 * r  # [rank*10 + 0..3]
    y, dx = _run(
        lambda t: tpl.all_to_all(ps.tp_group, t), blocks, torch.ones(4, 1, device=device()) * (r + 1)
    )
    want = torch.tensor([0.0, 1.0, 10.0, 11.0] if r == 0 else [2.0, 3.0, 12.0, 13.0], device=device())
    assert_close(y.view(-1), want)
    assert_close(dx.view(-1), torch.tensor([1.0, 1.0, 2.0, 2.0], device=device()))
    # sp2hp: tokens sharded -> hidden sharded (every rank's tokens, this rank's hidden block); hp2sp undoes it.
    tokens = _full(9, 8, 6)  # [num_tokens, H]
    hp = tpl.all_to_all_sp2hp(tokens.chunk(tp, 0)[r])
    assert_close(hp, tokens.chunk(tp, -1)[r])
    assert_close(tpl.all_to_all_hp2sp(hp), tokens.chunk(tp, 0)[r])
    # A replicated parameter is counted on tp rank 0 only; a tp shard everywhere.
    p = torch.nn.Parameter(torch.zeros(1))
    assert tpl.param_is_not_tensor_parallel_duplicate(p) == (r == 0)
    tpl.set_tensor_model_parallel_attributes(p, True, 0, 1)
    assert tpl.param_is_not_tensor_parallel_duplicate(p)


@distributed_test(world_size=2, tp=2)
def test_seed_tracker_and_checkpoint_at_tp2(ps: ParallelState) -> None:
    tracker = tpl.model_parallel_cuda_manual_seed(1234)
    assert tpl.get_cuda_rng_tracker() is tracker is ps.rng_tracker
    states = tracker.get_states()
    if not torch.cuda.is_available():
        gen = torch.Generator
        assert torch.equal(
            states["model-parallel-rng"], gen().manual_seed(1234 + 2718 + ps.tp_rank).get_state()
        )
        assert torch.equal(states["data-parallel-rng"], gen().manual_seed(1234).get_state())
        assert torch.equal(
            states["expert-parallel-rng"], gen().manual_seed(1234 + 1024 + ps.tp_rank).get_state()
        )
    w = _full(4, 8, 8).requires_grad_(True)
    received: list[object] = []

    def block(h):
        received.append(h)
        with tracker.fork():  # a tp region: each rank its own mask
            h = F.dropout(h @ w, p=0.5)
        return F.dropout(h, p=0.5)

    x = _full(5, 4, 2, 8)
    results = []
    for how in ("plain", False, True):
        tracker.set_states(states)
        torch.manual_seed(7)
        xi = x.clone().requires_grad_(True)
        w.grad = None
        out = block(xi) if how == "plain" else tpl.checkpoint(block, how, xi)
        out.sum().backward()
        results.append((out.detach(), xi.grad, w.grad.clone()))
    for got in results[1:]:  # recompute (with the saved input split over tp, or not) = no recompute
        for a, b in zip(got, results[0]):
            assert_close(a, b, rtol=0, atol=0)
    assert all(isinstance(h, torch.Tensor) for h in received)  # the bool is never passed on
    masks = [torch.zeros(2, device=device()) for _ in range(2)]
    with tracker.fork():
        mine = torch.rand(2, device=tracker.device).to(device())
    dist.all_gather(masks, mine, group=ps.tp_group)
    assert not torch.equal(masks[0], masks[1])  # model-parallel states differ across tp ranks


@distributed_test(world_size=2, tp=2)
def test_broadcast_data_and_layers_at_tp2(ps: ParallelState) -> None:
    r = ps.tp_rank
    full = {"tokens": torch.arange(12).view(2, 6), "labels": torch.arange(12).view(2, 6) + 1}
    got = tpl.broadcast_data(["tokens", "labels"], full if r == 0 else None, torch.int64)
    for key in full:
        assert torch.equal(got[key].cpu(), full[key])

    from types import SimpleNamespace

    config = SimpleNamespace(
        params_dtype=torch.float32,
        sequence_parallel=False,
        perform_initialization=True,
        use_cpu_initialization=True,
    )

    def init(wt):
        return torch.nn.init.normal_(wt, generator=torch.Generator().manual_seed(11))

    master = init(torch.empty(8, 6))  # what use_cpu_initialization builds before splitting
    col = tpl.ColumnParallelLinear(6, 8, config=config, init_method=init, gather_output=True, bias=False).to(
        device()
    )
    assert col.weight.shape == (4, 6) and torch.equal(col.weight.detach().cpu(), master.chunk(2, 0)[r])
    x = _full(6, 3, 2, 6)
    out, bias = col(x)
    assert bias is None and out.shape == (3, 2, 8)
    assert_close(out.cpu(), (x @ master.t()).cpu())
    for disable, summed in ((False, True), (True, False)):
        lin = tpl.ColumnParallelLinear(
            6, 8, config=config, init_method=init, bias=False, disable_grad_reduce=disable
        ).to(device())
        xi = x.clone().requires_grad_(True)
        lin(xi)[0].sum().backward()
        want = (master.sum(0) if summed else master.chunk(2, 0)[r].sum(0)).expand(3, 2, 6)
        assert_close(xi.grad.cpu(), want)  # the input gradient all-reduced over tp, or this rank's part
    row = tpl.RowParallelLinear(
        8, 6, config=config, init_method=init, bias=True, input_is_parallel=False, skip_bias_add=False
    ).to(device())
    master_row = init(torch.empty(6, 8))
    assert torch.equal(row.weight.detach().cpu(), master_row.chunk(2, 1)[r])
    y, _ = row(out)
    assert_close(y.cpu(), out.cpu() @ master_row.t())
    emb = tpl.VocabParallelEmbedding(10, 4, init_method=init, config=config)
    assert (emb.vocab_start_index, emb.vocab_end_index) == ((0, 5) if r == 0 else (5, 10))
    # The functional linear with sequence parallelism on the default group: gathers the sequence.
    inp, wt = _full(7, 4, 2, 6), _full(8, 5, 6)
    part = inp.chunk(2, 0)[r].clone().requires_grad_(True)
    res = tpl.linear_with_grad_accumulation_and_async_allreduce(part, wt, None, False, False, True)
    assert_close(res, inp @ wt.t())
