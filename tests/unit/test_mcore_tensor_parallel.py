"""Megatron-Core 0.19.2's megatron.core.tensor_parallel names, signatures and defaults, one process.

Expected values come from Megatron-Core's documented behaviour: the tracker's seeds (seed + 2718 +
tp_rank, seed, seed + 1024 + 100 * ep_rank + etp_rank), ``checkpoint(function,
distribute_saved_activations, *args)`` calling ``function(*args)``, ``vocab_parallel_cross_entropy``'s
third positional argument being ``label_smoothing``, layers returning ``(output, bias)``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron.core import parallel_state
from megatron.core import tensor_parallel as tpl
from megatron.core.tensor_parallel import layers, mappings, random, rng_api, utils


@pytest.fixture(autouse=True)
def fresh_default_state():
    """Each test starts with no default ParallelState and no unbound tracker, and leaves none."""
    parallel_state.destroy_model_parallel()
    rng_api._UNBOUND = None
    with torch.random.fork_rng():
        yield
    parallel_state.destroy_model_parallel()
    rng_api._UNBOUND = None


def _state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _params(fn) -> dict[str, object]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


def test_signatures_and_defaults_are_megatrons() -> None:
    empty = inspect.Parameter.empty
    assert list(_params(tpl.model_parallel_cuda_manual_seed))[:8] == [
        "seed",
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "tp_rank",
        "ep_rank",
        "etp_rank",
        "force_reset_rng",
    ]
    assert _params(tpl.checkpoint) == {
        "function": empty,
        "distribute_saved_activations": empty,
        "args": empty,
    }
    assert _params(tpl.vocab_parallel_cross_entropy) == {
        "vocab_parallel_logits": empty,
        "target": empty,
        "label_smoothing": 0.0,
        "tp_group": None,
    }
    assert _params(tpl.gather_from_sequence_parallel_region) == {
        "input_": empty,
        "tensor_parallel_output_grad": True,
        "group": None,
        "output_split_sizes": None,
        "use_global_buffer": False,
    }
    assert _params(tpl.linear_with_grad_accumulation_and_async_allreduce) == {
        "input": empty,
        "weight": empty,
        "bias": empty,
        "gradient_accumulation_fusion": empty,
        "allreduce_dgrad": empty,
        "sequence_parallel": empty,
        "grad_output_buffer": None,
        "wgrad_deferral_limit": 0,
        "tp_group": None,
        "gtp_remat_size": 1,
    }
    for fn in (
        tpl.copy_to_tensor_model_parallel_region,
        tpl.reduce_from_tensor_model_parallel_region,
        tpl.scatter_to_tensor_model_parallel_region,
        tpl.gather_from_tensor_model_parallel_region,
        tpl.scatter_to_sequence_parallel_region,
        tpl.all_gather_last_dim_from_tensor_parallel_region,
        tpl.reduce_scatter_last_dim_to_tensor_parallel_region,
    ):
        assert _params(fn) == {"input_": empty, "group": None}, fn.__name__
    assert list(_params(tpl.broadcast_data))[:4] == ["keys", "data", "datatype", "tp_group"]
    col = _params(tpl.ColumnParallelLinear)
    for name, default in {
        "bias": True,
        "gather_output": False,
        "stride": 1,
        "keep_master_weight_for_test": False,
        "skip_bias_add": False,
        "skip_weight_param_allocation": False,
        "embedding_activation_buffer": None,
        "grad_output_buffer": None,
        "is_expert": False,
        "tp_comm_buffer_name": None,
        "disable_grad_reduce": False,
        "tp_group": None,
    }.items():
        assert col[name] == default, name
    assert {"config", "init_method", "input_is_parallel", "skip_bias_add", "tp_group"} <= set(
        _params(tpl.RowParallelLinear)
    )
    assert {"init_method", "reduce_scatter_embeddings", "config", "tp_group"} <= set(
        _params(tpl.VocabParallelEmbedding)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the CUDA generator is seeded instead")
def test_model_parallel_cuda_manual_seed_fills_megatrons_states_on_the_cpu() -> None:
    early = tpl.get_cuda_rng_tracker()  # before any seeding: the object seeding then fills
    assert isinstance(early, tpl.CudaRNGStatesTracker) and not early.is_initialized()
    tracker = tpl.model_parallel_cuda_manual_seed(77, tp_rank=3, ep_rank=1, etp_rank=2)
    assert tracker is early and tracker is tpl.get_cuda_rng_tracker()
    assert parallel_state.get_parallel_state().rng_tracker is tracker  # what default-state models use
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(77)))
    states = tracker.get_states()
    assert set(states) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    assert torch.equal(states["model-parallel-rng"], _state(77 + 2718 + 3))
    assert torch.equal(states[tpl.get_data_parallel_rng_tracker_name()], _state(77))
    assert torch.equal(states[tpl.get_expert_parallel_rng_tracker_name()], _state(77 + 1024 + 100 * 1 + 2))
    # Defaults: this rank's tp rank (0 here), etp rank = tp rank as Megatron's expert tp size = tp size.
    again = tpl.model_parallel_cuda_manual_seed(5)
    assert again is tracker
    assert torch.equal(again.get_states()["model-parallel-rng"], _state(5 + 2718))
    assert torch.equal(again.get_states()["expert-parallel-rng"], _state(5 + 1024))
    assert tpl.model_parallel_cuda_manual_seed(5, force_reset_rng=True) is not tracker
    for flag in ("te_rng_tracker", "use_cudagraphable_rng"):
        with pytest.raises(ValueError, match=f"{flag}=False"):
            tpl.model_parallel_cuda_manual_seed(1, **{flag: True})


def test_cuda_rng_states_tracker_forks_its_device() -> None:
    """On a CPU-only machine the tracker's states are CPU states and fork swaps the CPU generator."""
    tracker = tpl.CudaRNGStatesTracker()
    dev = tracker.device
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not tracker.is_initialized()
    tracker.add("a", 11)
    assert tracker.is_initialized()
    with pytest.raises(ValueError):
        tracker.add("b", 11)  # a seed used twice
    with pytest.raises(ValueError):
        tracker.add("a", 12)  # a name used twice
    torch.manual_seed(0)
    expected_default = torch.rand(3, device=dev)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(3, device=dev)
    assert torch.equal(first, torch.rand(3, device=dev, generator=torch.Generator(dev).manual_seed(11)))
    assert torch.equal(torch.rand(3, device=dev), expected_default)  # the default stream continues as before
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(3, device=dev)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3, device=dev), second)
    tracker.reset()
    assert tracker.get_states() == {} and not tracker.is_initialized()
    inference = tpl.CudaRNGStatesTracker(is_inference_rng_tracker=True)
    inference.add("model-parallel-rng", 3)
    torch.manual_seed(1)
    with inference.fork():
        drawn = torch.rand(2, device=dev)
    assert torch.equal(drawn, torch.rand(2, device=dev, generator=torch.Generator(dev).manual_seed(1)))
    with pytest.raises(ValueError, match="use_cudagraphable_rng=False"):
        tpl.CudaRNGStatesTracker(use_cudagraphable_rng=True)


def test_checkpoint_takes_megatrons_signature_and_replays_dropout() -> None:
    tpl.model_parallel_cuda_manual_seed(3)
    tracker = tpl.get_cuda_rng_tracker()
    w = torch.randn(6, 6, requires_grad=True)
    seen: list[tuple[object, ...]] = []

    def fn(x, scale):
        seen.append((x, scale))
        with tracker.fork():
            h = F.dropout(x @ w, p=0.5)
        return F.dropout(h, p=0.3) * scale

    x = torch.randn(4, 6, requires_grad=True)
    with torch.random.fork_rng():
        states = tracker.get_states()
        ref = fn(x, 2.0)
        ref.sum().backward()
        ref_dx, ref_dw = x.grad.clone(), w.grad.clone()
    tracker.set_states(states)
    x.grad = w.grad = None
    out = tpl.checkpoint(fn, False, x, 2.0)
    out.sum().backward()
    assert_close(out, ref, rtol=0, atol=0)
    assert_close(x.grad, ref_dx, rtol=0, atol=0)
    assert_close(w.grad, ref_dw, rtol=0, atol=0)
    assert all(s[1] == 2.0 and isinstance(s[0], torch.Tensor) for s in seen)  # never the bool
    assert len(seen) == 3  # reference, checkpointed forward, recompute
    out = tpl.checkpoint(fn, True, x, 2.0)  # at tp 1 distributing the saved input changes nothing
    with pytest.raises(TypeError, match="checkpoint\\(function, False, x\\)"):
        tpl.checkpoint(fn, x, 2.0)


def test_checkpoint_without_output_frees_and_recomputes_its_output() -> None:
    tpl.model_parallel_cuda_manual_seed(9)
    w1, w2 = torch.randn(5, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5, requires_grad=True)

    def norm(t):
        return F.dropout(torch.tanh(t @ w1), p=0.2)

    with torch.random.fork_rng():
        ref = (norm(x) @ w2).exp().sum()
        ref.backward()
    ref_grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    ckpt = tpl.CheckpointWithoutOutput()
    y = ckpt.checkpoint(norm, x)
    z = y @ w2  # matmul saves y for w2's gradient
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().nbytes() == 0  # freed until z's gradient is computed
    loss = z.exp().sum()
    assert_close(loss, ref)
    loss.backward()
    for t, g in zip((x, w1, w2), ref_grads):
        assert_close(t.grad, g)
    assert y.untyped_storage().nbytes() > 0


def test_vocab_parallel_cross_entropy_third_argument_is_label_smoothing() -> None:
    logits, target = torch.randn(3, 2, 11), torch.randint(0, 11, (3, 2))
    got = tpl.vocab_parallel_cross_entropy(logits, target, 0.1)
    want = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none", label_smoothing=0.1)
    assert_close(got, want.view(3, 2))


def test_utils() -> None:
    t = torch.arange(24.0).view(2, 12)
    parts = tpl.split_tensor_along_last_dim(t, 3)
    assert [p.shape for p in parts] == [(2, 4)] * 3 and torch.equal(torch.cat(parts, -1), t)
    assert all(p.is_contiguous() for p in tpl.split_tensor_along_last_dim(t, 3, contiguous_split_chunks=True))
    with pytest.raises(ValueError, match="not divisible by 5"):
        tpl.split_tensor_along_last_dim(t, 5)
    assert tpl.VocabUtility.vocab_range_from_global_vocab_size(12, 2, 4) == (6, 9)
    assert tpl.VocabUtility.vocab_range_from_per_partition_vocab_size(3, 1, 4) == (3, 6)
    chunk = tpl.split_tensor_into_1d_equal_chunks(t)  # tp 1: the whole tensor, flattened
    assert torch.equal(chunk, t.reshape(-1)) and torch.equal(tpl.gather_split_1d_tensor(chunk), t.reshape(-1))
    assert utils.split_tensor_into_1d_equal_chunks(t, new_buffer=True).data_ptr() != t.data_ptr()


def _config(**kw):
    base = dict(
        params_dtype=torch.float32,
        sequence_parallel=False,
        perform_initialization=True,
        use_cpu_initialization=True,
        init_method_std=0.02,
    )
    return SimpleNamespace(**{**base, **kw})


def test_layers_in_megatrons_form() -> None:
    def init(w):
        return torch.nn.init.constant_(w, 0.5)

    col = tpl.ColumnParallelLinear(4, 6, config=_config(), init_method=init, bias=True, skip_bias_add=True)
    assert col.weight.shape == (6, 4) and torch.all(col.weight == 0.5) and torch.all(col.bias == 0)
    x = torch.randn(3, 2, 4)
    out, bias = col(x)
    assert bias is col.bias and out.shape == (3, 2, 6)
    assert_close(out, x @ col.weight.t())
    row = tpl.RowParallelLinear(
        6,
        4,
        config=_config(use_cpu_initialization=False),
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    y, none = row(out.to(row.weight.device))  # initialised on the GPU when there is one
    assert none is None and torch.all(row.weight == 0.5)
    emb = tpl.VocabParallelEmbedding(10, 4, init_method=init, config=_config())
    assert emb(torch.tensor([[1, 9]])).shape == (1, 2, 4)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, 10)
    untouched = tpl.ColumnParallelLinear(4, 6, config=_config(perform_initialization=False), init_method=init)
    assert not torch.all(untouched.weight == 0.5) or untouched.weight.numel() == 0
    with pytest.raises(ValueError, match="init_std= .* or config= and init_method="):
        tpl.ColumnParallelLinear(4, 6)
    with pytest.raises(ValueError, match="init_method="):
        tpl.RowParallelLinear(4, 6, config=_config())
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        tpl.RowParallelLinear(
            4,
            6,
            config=_config(sequence_parallel=True),
            init_method=init,
            bias=False,
            input_is_parallel=False,
            skip_bias_add=False,
        )


def test_linear_and_parameter_attributes() -> None:
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert_close(
        tpl.linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, False, False), F.linear(x, w, b)
    )
    with pytest.raises(ValueError, match="allreduce_dgrad must be False"):
        tpl.linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, True, True)
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    tpl.set_tensor_model_parallel_attributes(p, True, 0, 1)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 1)
    with pytest.raises(ValueError, match="already has"):
        tpl.set_tensor_model_parallel_attributes(p, True, 0, 1)
    tpl.copy_tensor_model_parallel_attributes(q, p)
    assert q.partition_dim == 0 and tpl.param_is_not_tensor_parallel_duplicate(q)
    r = torch.nn.Parameter(torch.zeros(1))
    tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(r)
    assert (r.tensor_model_parallel, r.partition_dim, r.partition_stride) == (False, -1, 1)
    assert tpl.param_is_not_tensor_parallel_duplicate(r)  # tp rank 0 of one rank


def test_broadcast_data_and_all_to_all_on_one_rank() -> None:
    data = {"tokens": torch.arange(6).view(2, 3), "labels": torch.ones(2, 3, dtype=torch.int64)}
    out = tpl.broadcast_data(["tokens", "labels"], data, torch.int64)
    assert torch.equal(out["tokens"], data["tokens"]) and torch.equal(out["labels"], data["labels"])
    with pytest.raises(ValueError, match="datatype=torch.int32"):
        tpl.broadcast_data(["tokens"], data, torch.int32)
    with pytest.raises(ValueError, match="all_to_all needs its group"):
        tpl.all_to_all(None, torch.zeros(2))
    x = torch.randn(4, 6)
    assert tpl.all_gather_last_dim_from_tensor_parallel_region(x) is x
    assert mappings.copy_to_tensor_model_parallel_region(x) is x


def test_library_names_keep_their_explicit_group_forms() -> None:
    """The library's own callers use the explicit-group forms (None there means no tp)."""
    assert random.checkpoint_with_rng is not random.checkpoint
    assert layers.ColumnParallelLinear(4, 6, init_std=0.1).tp_group is None
