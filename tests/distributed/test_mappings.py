"""Every autograd collective of mappings.py, forward and backward, against the unsharded math."""

from __future__ import annotations

import pytest
import torch
from harness import device, distributed_test
from torch.testing import assert_close

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import mappings as m

S, B, H = 8, 2, 12  # [s, b, h]; s and h divisible by 1, 2 and 4


def _full(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=gen).to(device())


def _run(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and d(sum(fn(x) * grad))/dx."""
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("tp", [2, 4])
@distributed_test(world_size="tp", tp="tp")
def test_last_dim_collectives(ps: ParallelState, tp: int) -> None:
    g, r = ps.tp_group, ps.tp_rank
    x, grad = _full(0), _full(1)
    scale = tp * (tp + 1) / 2  # sum over ranks of (rank + 1)

    # copy_to: identity forward; backward sums the ranks' (different) gradients.
    y, dx = _run(lambda t: m.copy_to_tensor_model_parallel_region(t, g), x, grad * (r + 1))
    assert_close(y, x, rtol=0, atol=0)
    assert_close(dx, grad * scale)

    # reduce_from: all-reduce forward; identity backward.
    y, dx = _run(lambda t: m.reduce_from_tensor_model_parallel_region(t, g), x * (r + 1), grad)
    assert_close(y, x * scale)
    assert_close(dx, grad, rtol=0, atol=0)

    # scatter_to: this rank's last-dim slice forward; all-gather backward.
    y, dx = _run(lambda t: m.scatter_to_tensor_model_parallel_region(t, g), x, grad.chunk(tp, -1)[r])
    assert_close(y, x.chunk(tp, -1)[r], rtol=0, atol=0)
    assert_close(dx, grad, rtol=0, atol=0)

    # gather_from: all-gather forward; this rank's slice backward.
    y, dx = _run(lambda t: m.gather_from_tensor_model_parallel_region(t, g), x.chunk(tp, -1)[r], grad)
    assert_close(y, x, rtol=0, atol=0)
    assert_close(dx, grad.chunk(tp, -1)[r], rtol=0, atol=0)


@pytest.mark.parametrize("tp", [2, 4])
@distributed_test(world_size="tp", tp="tp")
def test_sequence_collectives(ps: ParallelState, tp: int) -> None:
    g, r = ps.tp_group, ps.tp_rank
    x, grad = _full(2), _full(3)
    scale = tp * (tp + 1) / 2

    # scatter_to_sequence: dim-0 slice forward; all-gather backward.
    y, dx = _run(lambda t: m.scatter_to_sequence_parallel_region(t, g), x, grad.chunk(tp, 0)[r])
    assert_close(y, x.chunk(tp, 0)[r], rtol=0, atol=0)
    assert_close(dx, grad, rtol=0, atol=0)

    # gather_from_sequence feeding a tp-parallel consumer: backward reduce-scatters.
    y, dx = _run(
        lambda t: m.gather_from_sequence_parallel_region(t, group=g), x.chunk(tp, 0)[r], grad * (r + 1)
    )
    assert_close(y, x, rtol=0, atol=0)
    assert_close(dx, (grad * scale).chunk(tp, 0)[r])

    # ... feeding a replicated consumer: backward only keeps this rank's slice.
    y, dx = _run(
        lambda t: m.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False, group=g),
        x.chunk(tp, 0)[r],
        grad,
    )
    assert_close(y, x, rtol=0, atol=0)
    assert_close(dx, grad.chunk(tp, 0)[r], rtol=0, atol=0)

    # reduce_scatter_to_sequence: reduce-scatter forward; all-gather backward.
    y, dx = _run(
        lambda t: m.reduce_scatter_to_sequence_parallel_region(t, g), x * (r + 1), grad.chunk(tp, 0)[r]
    )
    assert_close(y, (x * scale).chunk(tp, 0)[r])
    assert_close(dx, grad, rtol=0, atol=0)


@distributed_test(world_size=2, tp=2)
def test_collectives_do_not_touch_tensors_autograd_shares(ps: ParallelState) -> None:
    """Autograd may hand one gradient tensor to several consumers (``a + b`` gives both the same):
    a backward that all-reduced it in place would corrupt the other branch's gradient."""
    g, r = ps.tp_group, ps.tp_rank
    x, z = _full(4).requires_grad_(True), _full(5).requires_grad_(True)
    w = _full(6) * (r + 1)  # a different upstream gradient on each rank
    out = m.copy_to_tensor_model_parallel_region(x, g) + z
    out.backward(w)
    assert_close(z.grad, w, rtol=0, atol=0)
    assert_close(x.grad, _full(6) * 3)

    # Forward inputs are not modified either.
    a = (_full(7) * (r + 1)).requires_grad_(True)
    before = a.detach().clone()
    m.reduce_from_tensor_model_parallel_region(a * 1, g).sum().backward()
    b = a.detach() * 1
    m.reduce_from_tensor_model_parallel_region(b, g)
    assert_close(b, before, rtol=0, atol=0)
    c = a.detach() * 1
    m.reduce_scatter_to_sequence_parallel_region(c, g)
    assert_close(c, before, rtol=0, atol=0)


@distributed_test(world_size=2, tp=2)
def test_indivisible_split_is_a_clear_error(ps: ParallelState) -> None:
    x = torch.zeros(3, 2, 5, device=device())
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        m.scatter_to_tensor_model_parallel_region(x, ps.tp_group)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        m.scatter_to_sequence_parallel_region(x, ps.tp_group)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        m.reduce_scatter_to_sequence_parallel_region(x, ps.tp_group)


def test_single_rank_group_is_identity() -> None:
    x = torch.randn(4, 2, 6)
    fns = [
        m.copy_to_tensor_model_parallel_region,
        m.reduce_from_tensor_model_parallel_region,
        m.scatter_to_tensor_model_parallel_region,
        m.gather_from_tensor_model_parallel_region,
        m.scatter_to_sequence_parallel_region,
        m.gather_from_sequence_parallel_region,
        m.reduce_scatter_to_sequence_parallel_region,
    ]
    for fn in fns:
        assert fn(x, None) is x
