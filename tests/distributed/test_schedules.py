"""Recorded traces of the pipeline schedules, run in one process (one thread per pipeline rank).

A fake communicator passes tensors through per-link FIFO queues and records every batched exchange;
a fake model chunk multiplies by a weight of 1, so each activation carries its micro-batch id and
every forward / backward can be attributed. Checked per rank: the exact 1F1B trace of a small case,
the interleaved (micro-batch, chunk) order against Megatron's table, that the recorded exchanges
form a lock-step (deadlock-free even when a send waits for its receive, as on NCCL), the peak of
live activations, the no_sync contract, gradients, and the bad-layout messages.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.pipeline_parallel.interleaved import check_interleaving, schedule_table
from megatron.core.pipeline_parallel.p2p_communication import Exchange, P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

SHAPE = (2, 1, 3)  # [s, b, h]


class FakeComm(P2PCommunicator):
    """Per-link FIFO queues instead of torch.distributed; records each non-empty exchange."""

    def __init__(self, rank: int, pp: int, links: dict, trace: list):
        self.pp_rank, self.pp_size, self.links, self.trace = rank, pp, links, trace
        self.next_rank, self.prev_rank = (rank + 1) % pp, (rank - 1) % pp
        self.batches: list[dict] = []

    def communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        ops = []
        if send_next is not None:
            self.links[self.pp_rank, self.next_rank].put(("act", send_next.detach().clone()))
            ops.append("s+")
        if send_prev is not None:
            self.links[self.pp_rank, self.prev_rank].put(("grad", send_prev.detach().clone()))
            ops.append("s-")
        got = [None, None]
        for i, (flag, peer, kind, tag) in enumerate(
            ((recv_prev, self.prev_rank, "act", "r-"), (recv_next, self.next_rank, "grad", "r+"))
        ):
            if flag:
                got_kind, tensor = self.links[peer, self.pp_rank].get(timeout=20)
                assert got_kind == kind, f"rank {self.pp_rank} expected {kind} from {peer}, got {got_kind}"
                got[i] = tensor.requires_grad_(kind == "act")
                ops.append(tag)
        if ops:
            self.trace.append("|" + " ".join(ops) + "|")
            self.batches.append(
                {"s+": send_next is not None, "s-": send_prev is not None, "r-": recv_prev, "r+": recv_next}
            )
        return got[0], got[1]

    def post(self, **kwargs):
        """Completes at once (the queues are the wire); the schedule waits on it later."""
        return Exchange([], *self.communicate(**kwargs))


class _Track(torch.autograd.Function):
    """Identity that records forward/backward events and live activations."""

    @staticmethod
    def forward(ctx, x, chunk, stats):
        ctx.chunk, ctx.stats, ctx.mb = chunk, stats, int(x.flatten()[0].item())
        stats["live"] += 1
        stats["peak"] = max(stats["peak"], stats["live"])
        stats["trace"].append(f"F{chunk}")
        stats["fwd"].append((ctx.mb, chunk))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stats["live"] -= 1
        ctx.stats["trace"].append(f"B{ctx.chunk}")
        ctx.stats["bwd"].append((ctx.mb, ctx.chunk, ctx.stats["synced"][ctx.chunk]))
        return grad, None, None


class FakeChunk(torch.nn.Module):
    def __init__(self, rank: int, pp: int, chunk: int, num_chunks: int, config, stats):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.ones(())
        )  # no process groups: the schedule takes them from the comm
        self.config, self.stats, self.chunk = config, stats, chunk
        self.pre_process = rank == 0 and chunk == 0
        self.post_process = rank == pp - 1 and chunk == num_chunks - 1
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, data_iterator):
        x = next(data_iterator) if self.pre_process else self.input_tensor
        return _Track.apply(x * self.weight, self.chunk, self.stats)


def _forward_step(data_iterator, model):
    out = model(data_iterator)
    return out, lambda y: (y.sum(), {"mb": y.detach().flatten()[0]})


def _run_rank(rank, pp, v, m, links, results, forward_only, overlap=True):
    stats = {"live": 0, "peak": 0, "trace": [], "fwd": [], "bwd": [], "synced": [True] * v, "finalized": 0}
    config = SimpleNamespace(
        calculate_per_token_loss=False,
        grad_scale_func=None,
        hidden_size=SHAPE[2],
        microbatch_group_size_per_virtual_pipeline_stage=None,
        overlap_p2p_comm=overlap,
        finalize_model_grads_func=lambda chunks, n: stats.__setitem__("finalized", 1 + stats["finalized"]),
    )

    def no_sync_for(c):
        class _Ctx:
            def __enter__(self):
                stats["synced"][c] = False

            def __exit__(self, *a):
                stats["synced"][c] = True

        return _Ctx

    config.no_sync_func = [no_sync_for(c) for c in range(v)] if v > 1 else no_sync_for(0)
    chunks = [FakeChunk(rank, pp, c, v, config, stats) for c in range(v)]
    data = iter([torch.full(SHAPE, float(i)) for i in range(m)])
    comm = FakeComm(rank, pp, links, stats["trace"])
    func = get_forward_backward_func(pp, v)
    metrics = func(
        forward_step_func=_forward_step,
        data_iterator=[data if c == 0 else None for c in range(v)],
        model=chunks,
        num_microbatches=m,
        seq_length=SHAPE[0],
        micro_batch_size=SHAPE[1],
        forward_only=forward_only,
        p2p_communicator=comm,
    )
    results[rank] = dict(
        stats,
        metrics=[int(x["mb"]) for x in metrics],
        batches=comm.batches,
        grads=[c.weight.grad for c in chunks],
    )


def run_pipeline(pp: int, v: int, m: int, forward_only: bool = False, overlap: bool = True) -> dict:
    links = {(a, b): queue.Queue() for a in range(pp) for b in range(pp)}
    results, errors = {}, []

    def target(r):
        try:
            _run_rank(r, pp, v, m, links, results, forward_only, overlap)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((r, e))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def assert_lockstep(results: dict, pp: int) -> None:
    """Matched send/recv batches can be given one global step each, monotone per rank: no cycle."""
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a in range(pp):
        for direction, recv_tag, b in (("s+", "r-", (a + 1) % pp), ("s-", "r+", (a - 1) % pp)):
            sends = [i for i, bt in enumerate(results[a]["batches"]) if bt[direction]]
            recvs = [i for i, bt in enumerate(results[b]["batches"]) if bt[recv_tag]]
            assert len(sends) == len(recvs), (a, b, direction)
            for i, j in zip(sends, recvs):
                parent[find((a, i))] = find((b, j))
    edges: dict = {}
    for r in range(pp):
        n = len(results[r]["batches"])
        for i in range(n - 1):
            edges.setdefault(find((r, i)), set()).add(find((r, i + 1)))
    state: dict = {}

    def visit(node):  # depth-first cycle check
        state[node] = 1
        for nxt in edges.get(node, ()):
            assert nxt != node and state.get(nxt) != 1, "exchanges cannot be ordered: possible deadlock"
            if nxt not in state:
                visit(nxt)
        state[node] = 2

    for node in list(edges):
        if node not in state:
            visit(node)


def test_1f1b_trace_pp2():
    res = run_pipeline(pp=2, v=1, m=3)
    assert res[0]["trace"] == ["F0", "|s+|", "F0", "|s+ r+|", "B0", "F0", "|s+ r+|", "B0", "|r+|", "B0"]
    assert res[1]["trace"] == ["|r-|", "F0", "B0", "|s- r-|", "F0", "B0", "|s- r-|", "F0", "B0", "|s-|"]
    assert res[1]["metrics"] == [0, 1, 2] and res[0]["metrics"] == []


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 2), (3, 5)])
def test_1f1b_order_memory_and_grads(pp, m):
    res = run_pipeline(pp=pp, v=1, m=m)
    assert_lockstep(res, pp)
    for r in range(pp):
        out = res[r]
        warmup = min(pp - r - 1, m)
        assert out["trace"][0:1] != ["B0"]
        computes = [e for e in out["trace"] if e[0] in "FB"]
        assert computes[: warmup + 1] == ["F0"] * (warmup + 1) or m == warmup
        assert out["peak"] == min(pp - r, m)  # the 1F1B bound: pp - rank in-flight micro-batches
        assert [mb for mb, _ in out["fwd"]] == list(range(m)) and [mb for mb, _, _ in out["bwd"]] == list(
            range(m)
        )
        assert [s for _, _, s in out["bwd"]] == [False] * (m - 1) + [True]  # sync only in the last backward
        assert out["finalized"] == 1
        # loss = sum over micro-batches of sum(y) / m; y = x * prod(weights) with weights 1
        expected = sum(i * 6 for i in range(m)) / m
        assert out["grads"][0].item() == pytest.approx(expected)
    assert res[pp - 1]["metrics"] == list(range(m))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 3, 4), (3, 2, 6), (2, 3, 6)])
def test_interleaved_order_memory_and_grads(pp, v, m, overlap):
    res = run_pipeline(pp=pp, v=v, m=m, overlap=overlap)
    assert_lockstep(res, pp)
    table = schedule_table(m, v, pp)
    total = m * v
    for r in range(pp):
        out = res[r]
        assert out["fwd"] == table
        assert [(mb, c) for mb, c, _ in out["bwd"]] == [(mb, v - 1 - c) for mb, c in table]
        warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        computes = [e for e in out["trace"] if e[0] in "FB"]
        first_b = computes.index(next(e for e in computes if e[0] == "B"))
        assert first_b == min(warmup + 1, total)
        assert out["peak"] <= min(warmup + 1, total)
        for c in range(v):  # sync only in each chunk's last backward
            flags = [s for _, cc, s in out["bwd"] if cc == c]
            assert flags == [False] * (m - 1) + [True]
            expected = sum(i * 6 for i in range(m)) / m
            assert out["grads"][c].item() == pytest.approx(expected)
        assert out["finalized"] == 1
    assert res[pp - 1]["metrics"] == [mb for mb, c in table if c == v - 1]


@pytest.mark.parametrize("v", [1, 2])
def test_forward_only_runs_through_the_same_schedules(v):
    res = run_pipeline(pp=2, v=v, m=4, forward_only=True)
    assert_lockstep(res, 2)
    for r in range(2):
        assert res[r]["bwd"] == [] and res[r]["finalized"] == 0 and res[r]["grads"][0] is None
    assert sorted(res[1]["metrics"]) == [0, 1, 2, 3]


def test_dispatch_and_no_pipelining_contract():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(2) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2).__name__ == "forward_backward_pipelining_with_interleaving"
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size > 1"):
        get_forward_backward_func(1, 2)


@pytest.mark.parametrize(
    "m, pp, g, message",
    [
        (1, 2, None, "needs at least 2"),
        (5, 4, None, "last group has 1 < pipeline_model_parallel_size 4"),
        (8, 4, 2, "must be at least pipeline_model_parallel_size 4"),
    ],
)
def test_interleaving_micro_batch_checks(m, pp, g, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_interleaving(m, pp, g)
    assert "global_batch_size" in str(err.value) or g is not None
    assert "pipeline_model_parallel_size" in err.value.params
