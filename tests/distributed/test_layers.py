"""Column/Row/VocabParallel layers and the vocab-parallel cross entropy against the one-process layer.

The reference is the same layer built with no tp group and initialised from the same seed and name
(``init_param_``), so the parallel layer must hold exactly the reference's shard. Output, input
gradient and weight-gradient shards are compared, for tp 2 and 4, with and without sequence
parallelism (input ``[s, b, h]`` sharded along dim 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import device, distributed_test
from torch.testing import assert_close

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.init import init_param_

S, B, H_IN, H_OUT, VOCAB, SEED = 8, 2, 12, 16, 32, 1234


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device())


def _init(layer: torch.nn.Module, name: str, tp_rank: int) -> torch.nn.Module:
    layer.to(device())
    for pname, p in layer.named_parameters():
        init_param_(p, f"{name}.{pname}", SEED, tp_rank=tp_rank)
    return layer


def _grad_step(
    layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), x.grad


GRID = [(tp, sp) for tp in (2, 4) for sp in (False, True)]


@pytest.mark.parametrize("tp,sp", GRID)
@pytest.mark.parametrize("gather_output", [False, True])
@distributed_test(world_size="tp", tp="tp")
def test_column_parallel_linear(ps: ParallelState, tp: int, sp: bool, gather_output: bool) -> None:
    r = ps.tp_rank
    ref = _init(ColumnParallelLinear(H_IN, H_OUT, init_std=0.1), "col", 0)
    par = _init(
        ColumnParallelLinear(
            H_IN, H_OUT, init_std=0.1, tp_group=ps.tp_group, sequence_parallel=sp, gather_output=gather_output
        ),
        "col",
        r,
    )
    bias = _rand(H_OUT, seed=5)
    with torch.no_grad():
        ref.bias.copy_(bias)
        par.bias.copy_(bias.chunk(tp)[r])
    assert_close(par.weight, ref.weight.chunk(tp, 0)[r], rtol=0, atol=0)  # layout-invariant init

    x, grad = _rand(S, B, H_IN, seed=1), _rand(S, B, H_OUT, seed=2)
    y_ref, dx_ref = _grad_step(ref, x, grad)
    x_par = x.chunk(tp, 0)[r] if sp else x
    g_par = grad if gather_output else grad.chunk(tp, -1)[r]
    y, dx = _grad_step(par, x_par, g_par)

    assert_close(y, y_ref if gather_output else y_ref.chunk(tp, -1)[r])
    assert_close(dx, dx_ref.chunk(tp, 0)[r] if sp else dx_ref)
    assert_close(par.weight.grad, ref.weight.grad.chunk(tp, 0)[r])
    assert_close(par.bias.grad, ref.bias.grad.chunk(tp, 0)[r])


@pytest.mark.parametrize("tp,sp", GRID)
@distributed_test(world_size="tp", tp="tp")
def test_row_parallel_linear(ps: ParallelState, tp: int, sp: bool) -> None:
    r = ps.tp_rank
    ref = _init(RowParallelLinear(H_IN, H_OUT, init_std=0.1), "row", 0)
    par = _init(
        RowParallelLinear(H_IN, H_OUT, init_std=0.1, tp_group=ps.tp_group, sequence_parallel=sp), "row", r
    )
    bias = _rand(H_OUT, seed=6)
    with torch.no_grad():
        ref.bias.copy_(bias)
        par.bias.copy_(bias)
    assert_close(par.weight, ref.weight.chunk(tp, 1)[r], rtol=0, atol=0)
    assert par.bias.sequence_parallel == sp

    x, grad = _rand(S, B, H_IN, seed=3), _rand(S, B, H_OUT, seed=4)
    y_ref, dx_ref = _grad_step(ref, x, grad)
    y, dx = _grad_step(par, x.chunk(tp, -1)[r], grad.chunk(tp, 0)[r] if sp else grad)

    assert_close(y, y_ref.chunk(tp, 0)[r] if sp else y_ref)
    assert_close(dx, dx_ref.chunk(tp, -1)[r])
    assert_close(par.weight.grad, ref.weight.grad.chunk(tp, 1)[r])
    bias_grad = par.bias.grad.clone()
    if sp:  # each rank saw only its sequence shard: finalize_model_grads all-reduces it over tp
        dist.all_reduce(bias_grad, group=ps.tp_group)
    assert_close(bias_grad, ref.bias.grad)


@pytest.mark.parametrize("tp,sp", GRID)
@distributed_test(world_size="tp", tp="tp")
def test_row_parallel_skip_bias_add(ps: ParallelState, tp: int, sp: bool) -> None:
    par = RowParallelLinear(
        H_IN, H_OUT, init_std=0.1, tp_group=ps.tp_group, sequence_parallel=sp, skip_bias_add=True
    )
    _init(par, "row", ps.tp_rank)
    out, bias = par(_rand(S, B, H_IN // tp, seed=7))
    assert bias is par.bias and out.shape == ((S // tp if sp else S), B, H_OUT)


@pytest.mark.parametrize("tp,sp", GRID)
@distributed_test(world_size="tp", tp="tp")
def test_vocab_parallel_embedding(ps: ParallelState, tp: int, sp: bool) -> None:
    r = ps.tp_rank
    ref = _init(VocabParallelEmbedding(VOCAB, H_IN, init_std=0.1), "emb", 0)
    par = _init(
        VocabParallelEmbedding(VOCAB, H_IN, init_std=0.1, tp_group=ps.tp_group, reduce_scatter_embeddings=sp),
        "emb",
        r,
    )
    assert_close(par.weight, ref.weight.chunk(tp, 0)[r], rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8)).to(device())
    ids[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // tp - 1, VOCAB // tp])  # the range edges
    grad = _rand(B, S, H_IN, seed=9)

    y_ref = ref(ids)
    y_ref.backward(grad)
    y = par(ids)
    if sp:  # [s/tp, b, h]
        assert_close(y, y_ref.transpose(0, 1).chunk(tp, 0)[r])
        y.backward(grad.transpose(0, 1).chunk(tp, 0)[r])
    else:
        assert_close(y, y_ref)
        y.backward(grad)
    assert_close(par.weight.grad, ref.weight.grad.chunk(tp, 0)[r])


@pytest.mark.parametrize("tp,smoothing", [(2, 0.0), (4, 0.0), (2, 0.1)])
@distributed_test(world_size="tp", tp="tp")
def test_vocab_parallel_cross_entropy(ps: ParallelState, tp: int, smoothing: float) -> None:
    r = ps.tp_rank
    logits = _rand(S, B, VOCAB, seed=10) * 3
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(11)).to(device())
    target[0] = torch.tensor([0, VOCAB - 1])
    grad = _rand(S, B, seed=12)

    full = logits.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(
        full.view(-1, VOCAB), target.view(-1), reduction="none", label_smoothing=smoothing
    ).view(S, B)
    loss_ref.backward(grad)

    shard = logits.chunk(tp, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=smoothing, tp_group=ps.tp_group)
    assert loss.shape == (S, B) and loss.dtype == torch.float32
    assert_close(loss, loss_ref.detach())
    loss.backward(grad)
    assert_close(shard.grad, full.grad.chunk(tp, -1)[r])

    # A second backward through a retained graph gives the same gradient (saved tensors intact).
    shard.grad = None
    loss = vocab_parallel_cross_entropy(
        shard.bfloat16(), target, label_smoothing=smoothing, tp_group=ps.tp_group
    )
    loss.backward(grad, retain_graph=True)
    first = shard.grad.clone()
    shard.grad = None
    loss.backward(grad)
    assert_close(shard.grad, first, rtol=0, atol=0)


@pytest.mark.parametrize("tp", [2])
@distributed_test(world_size="tp", tp="tp")
def test_column_parallel_strided_and_tied_weight(ps: ParallelState, tp: int) -> None:
    """SwiGLU's ``[gate; up]`` (partition_stride 2): each half is split separately; and a tied
    weight passed to ``forward`` is used instead of an own one."""
    r = ps.tp_rank
    ref = _init(ColumnParallelLinear(H_IN, 2 * H_OUT, init_std=0.1, bias=False, partition_stride=2), "fc1", 0)
    par = _init(
        ColumnParallelLinear(
            H_IN, 2 * H_OUT, init_std=0.1, bias=False, partition_stride=2, tp_group=ps.tp_group
        ),
        "fc1",
        r,
    )
    gate, up = ref.weight.chunk(2, 0)
    assert_close(par.weight, torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]]), rtol=0, atol=0)

    tied = ColumnParallelLinear(
        H_IN, VOCAB, init_std=0.1, bias=False, tp_group=ps.tp_group, skip_weight_param_allocation=True
    )
    assert tied.weight is None and list(tied.parameters()) == []
    w = _rand(VOCAB, H_IN, seed=13).chunk(tp, 0)[r]
    x = _rand(S, B, H_IN, seed=14)
    out, _ = tied(x, weight=w)
    assert_close(out, x @ w.t())


@distributed_test(world_size=2, tp=2)
def test_indivisible_sizes_name_the_flag(ps: ParallelState) -> None:
    with pytest.raises(
        ValueError, match="output size \\(3\\) is not divisible by tensor_model_parallel_size 2"
    ):
        ColumnParallelLinear(4, 3, init_std=0.1, tp_group=ps.tp_group)
    with pytest.raises(ValueError, match="input size"):
        RowParallelLinear(3, 4, init_std=0.1, tp_group=ps.tp_group)
    with pytest.raises(ValueError, match="padded vocabulary size"):
        VocabParallelEmbedding(33, 4, init_std=0.1, tp_group=ps.tp_group)
