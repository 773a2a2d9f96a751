"""DistributedDataParallel: overlapped bucketed reduction gives the same gradients as reducing at
the end, and both equal the gradient of the whole batch on one process."""

from __future__ import annotations

import pytest
import torch
from harness import device, distributed_test
from torch.testing import assert_close

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.host_transfers import HostTransfers

VOCAB, SEQ, MBS, MICRO = 64, 16, 2, 2


def _model(ps: ParallelState) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        share_embeddings_and_output_weights=True,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_state=ps,
        device=device(),
        seed=7,
    )


def _batches(dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, VOCAB, (MICRO, MBS * dp_size, SEQ), generator=g)
    return [full[m, dp_rank * MBS : (dp_rank + 1) * MBS].to(device()) for m in range(MICRO)]


def _grads(ps: ParallelState, ddp_config: DistributedDataParallelConfig) -> torch.Tensor:
    model = DistributedDataParallel(_model(ps).config, ddp_config, _model(ps), ps)
    batches = _batches(ps.dp_rank, ps.dp_size)
    with model.no_sync():
        for ids in batches[:-1]:
            (model(ids, None, None, labels=ids).mean() / MICRO).backward()
    ids = batches[-1]
    (model(ids, None, None, labels=ids).mean() / MICRO).backward()
    if ddp_config.overlap_grad_reduce:
        assert all(b.handle is not None for b in model.buckets), "every bucket should start during backward"
    finalize_model_grads([model])
    return model.grad_buffer.clone()


@distributed_test(world_size=2)
def test_overlap_matches_end_of_step_reduction_and_one_process(ps: ParallelState) -> None:
    plain = _grads(ps, DistributedDataParallelConfig())
    overlapped = _grads(ps, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=3000))
    assert_close(overlapped, plain, rtol=0, atol=0)
    averaged = _grads(
        ps,
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=3000, average_in_collective=True),
    )
    assert_close(averaged, plain)
    # One process seeing both ranks' samples in each micro-batch computes the same mean gradient.
    solo = ParallelState(grid=RankGrid(), rank=0)
    model = _model(solo)
    for ids in [torch.cat(_batches_all(m)) for m in range(MICRO)]:
        (model(ids, None, None, labels=ids).mean() / MICRO).backward()
    reference = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    assert_close(plain, reference, rtol=1e-5, atol=1e-7)


def _batches_all(m: int) -> list[torch.Tensor]:
    return [_batches(r, 2)[m] for r in range(2)]


def test_gradient_memory_appears_bucket_by_bucket_during_backward() -> None:
    """No gradient memory at the start of backward (when activations peak); buckets are created as
    their gradients arrive and returned when the next step starts."""
    solo = ParallelState(grid=RankGrid(), rank=0)
    # alias_single_gradients off: with one DP rank the buckets would otherwise not be needed at all.
    model = DistributedDataParallel(
        _model(solo).config,
        DistributedDataParallelConfig(bucket_size=3000, alias_single_gradients=False),
        _model(solo),
        solo,
    )
    assert len(model.buckets) > 2 and all(b.view is None for b in model.buckets)
    allocated_when_first_grad_arrived = []
    first = model.buckets[0].params[0]
    first.register_post_accumulate_grad_hook(
        lambda p: allocated_when_first_grad_arrived.append(sum(b.view is not None for b in model.buckets))
    )
    ids = _batches(0, 1)[0]
    model(ids, None, None, labels=ids).mean().backward()
    assert allocated_when_first_grad_arrived == [1]
    finalize_model_grads([model])
    assert all(b.view is not None for b in model.buckets)
    model.zero_grad_buffer()
    assert all(b.view is None for b in model.buckets)
    assert all(getattr(p, "main_grad", None) is None for p in model.module.parameters())


def test_param_without_gradient_reads_zero_in_uninitialised_bucket(monkeypatch) -> None:
    """Buckets are allocated uninitialised and filled by the first gradient's copy; a parameter that
    got no gradient this step must still read zeros after finalize, whatever the storage held."""
    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    real_empty = torch.empty
    monkeypatch.setattr(ddp_mod.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    solo = ParallelState(grid=RankGrid(), rank=0)
    module = _model(solo)
    module.unused = torch.nn.Parameter(torch.ones(5, device=device()))
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module, solo)
    reference = _model(solo)
    batches = _batches(0, 1) * 2  # four micro-batches: copy, then three accumulations
    with model.no_sync():
        for ids in batches[:-1]:
            (model(ids, None, None, labels=ids).mean() / 4).backward()
    (model(batches[-1], None, None, labels=batches[-1]).mean() / 4).backward()
    for ids in batches:
        (reference(ids, None, None, labels=ids).mean() / 4).backward()
    finalize_model_grads([model])
    assert torch.equal(module.unused.main_grad, torch.zeros(5, device=device()))
    expected = dict(reference.named_parameters())
    for name, p in module.named_parameters():
        if name != "unused":
            assert_close(p.main_grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)


@distributed_test(world_size=2)
def test_distributed_optimizer_keeps_state_only_for_owned_bucket_slices(ps: ParallelState) -> None:
    """Megatron's layout: every bucket is padded to a multiple of lcm(dp, 128) with params starting at
    multiples of 64 elements, and each rank's optimizer holds fp32 state only for the param elements
    of its contiguous half of every bucket; together the ranks cover every element exactly once, the
    params are views into the parameter buffers, and after a step the replicas hold identical weights."""
    import torch.distributed as dist

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=3000)
    model = DistributedDataParallel(_model(ps).config, ddp_config, _model(ps), ps)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    assert len(model.buckets) > 2 and len(model.param_buffers) == len(model.buckets)
    counts = []
    for bucket, buffer in zip(model.buckets, model.param_buffers):
        assert bucket.numel % 128 == 0 and buffer.data.numel() == bucket.numel
        assert all(bucket.offsets[id(p)] % 64 == 0 for p in bucket.params)
        assert all(p.data_ptr() == buffer.data[bucket.offsets[id(p)] :].data_ptr() for p in bucket.params)
        lo, hi = buffer.shard
        assert (lo, hi) == (ps.dp_rank * bucket.numel // 2, (ps.dp_rank + 1) * bucket.numel // 2)
        owned = torch.zeros(bucket.numel, device=device())
        for piece in buffer.pieces:
            start = bucket.offsets[id(piece.param)]
            assert lo <= start + piece.start < start + piece.stop <= hi
            owned[start + piece.start : start + piece.stop] += 1
        counts.append(owned)
    flat_counts = torch.cat(counts)
    dist.all_reduce(flat_counts)
    in_params = torch.cat(
        [
            torch.zeros(b.numel, device=device()).index_fill_(
                0,
                torch.cat(
                    [torch.arange(b.offsets[id(p)], b.offsets[id(p)] + p.numel()) for p in b.params]
                ).to(device()),
                1.0,
            )
            for b in model.buckets
        ]
    )
    assert torch.equal(flat_counts, in_params)  # every param element once, no padding element
    assert all(t.dim() == 1 for t in opt.model_params)
    assert sum(t.numel() for t in opt.model_params) == sum(int(c.sum()) for c in counts)
    ids = _batches(ps.dp_rank, ps.dp_size)[0]
    model.zero_grad_buffer()
    model(ids, None, None, labels=ids).mean().backward()
    finalize_model_grads([model])
    ok, _, _ = opt.step()
    assert ok and len(opt.optimizer.state) == len(opt.model_params)
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])


def _bf16_model(ps: ParallelState) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        share_embeddings_and_output_weights=True,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_state=ps,
        device=device(),
        seed=7,
    )
    model.unused = torch.nn.Parameter(torch.ones(5, device=device(), dtype=torch.bfloat16))
    return model


def _bf16_step(
    alias: bool, micro: int
) -> tuple[DistributedDataParallel, list[torch.Tensor], list[torch.Tensor]]:
    """One optimizer step of the bf16 model over ``micro`` micro-batches; (model, main grads read by
    the optimizer, updated params)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    solo = ParallelState(grid=RankGrid(), rank=0)
    module = _bf16_model(solo)
    model = DistributedDataParallel(
        module.config, DistributedDataParallelConfig(alias_single_gradients=alias), module, solo
    )
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.05), [model])
    batches = (_batches(0, 1) * micro)[:micro]
    model.zero_grad_buffer()
    with model.no_sync():
        for ids in batches[:-1]:
            (model(ids, None, None, labels=ids).float().mean() / micro).backward()
    (model(batches[-1], None, None, labels=batches[-1]).float().mean() / micro).backward()
    finalize_model_grads([model])
    grads = [p.main_grad.clone() for p in module.parameters()]
    ok, norm, _ = opt.step()
    assert ok and norm > 0.05  # clipping is active, so the grad norm reaches the update
    return model, grads, [p.detach().clone() for p in module.parameters()]


def test_single_gradient_is_aliased_without_bucket_memory_and_steps_identically() -> None:
    """One DP rank, one micro-batch: each bf16 gradient is used as the main grad as is (no bucket is
    ever allocated, no fp32 copy), a parameter without gradient reads zeros, and the optimizer step
    gives bit-identical parameters to the fp32-buffer path (widening bf16 to fp32 is exact)."""
    model, grads, params = _bf16_step(alias=True, micro=1)
    assert all(b.view is None for b in model.buckets)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert torch.equal(model.module.unused.main_grad, torch.zeros(5, device=device(), dtype=torch.bfloat16))
    _, ref_grads, ref_params = _bf16_step(alias=False, micro=1)
    assert all(g.dtype == torch.float32 for g in ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g.float(), r)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def test_second_micro_batch_moves_aliased_gradient_into_fp32_buffer() -> None:
    """Gradient accumulation still sums in fp32: with three micro-batches the aliased first gradient
    is moved into the fp32 bucket and the result equals the copy-then-add path bit for bit."""
    model, grads, params = _bf16_step(alias=True, micro=3)
    assert all(g.dtype == torch.float32 for g in grads)
    _, ref_grads, ref_params = _bf16_step(alias=False, micro=3)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


@pytest.mark.parametrize("distopt", [False, True])
@distributed_test(world_size=2)
def test_gradients_reduced_where_autograd_left_them_match_the_bucket_copy(
    ps: ParallelState, distopt: bool
) -> None:
    """dp2, bf16 reduction, one micro-batch: each gradient is reduced in place where autograd left it
    (no bucket storage is ever allocated, no copy), except in the buckets kept apart for gradients that
    are summed again after the reduction (a sequence-parallel norm here); gradients and the weights
    after the step equal the copy-into-the-bucket path bit for bit, with either optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def run(alias: bool):
        module = _bf16_model(ps)
        module.decoder.final_layernorm.weight.sequence_parallel = True  # summed over tp later: not aliased
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False,
            overlap_grad_reduce=True,
            bucket_size=3000,
            alias_single_gradients=alias,
            use_distributed_optimizer=distopt,
        )
        model = DistributedDataParallel(module.config, ddp_config, module, ps)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.05), [model])
        ids = _batches(ps.dp_rank, ps.dp_size)[0]
        model.zero_grad_buffer()
        model(ids, None, None, labels=ids).float().mean().backward()
        finalize_model_grads([model])
        storage = [
            (b.view is not None, [getattr(p, "sequence_parallel", False) for p in b.params])
            for b in model.buckets
        ]
        grads = {n: model.owned_main_grad(p).clone() for n, p in module.named_parameters()}
        assert opt.step()[0]
        opt.finish_param_sync()
        return storage, grads, [p.detach().clone() for p in module.parameters()]

    storage, grads, weights = run(alias=True)
    # Without aliasing every bucket has storage; with it, only the sequence-parallel norm's own bucket.
    # The distributed optimizer reduce-scatters each bucket's storage: it never aliases.
    if distopt:
        assert all(held for held, _ in storage)
    else:
        assert [sp for held, sp in storage if held] == [[True]]
    assert sum(len(sp) for _, sp in storage) == len(grads) and len(storage) > 2
    ref_storage, ref_grads, ref_weights = run(alias=False)
    assert all(held for held, _ in ref_storage)
    for name, g in grads.items():  # (with the distributed optimizer: each rank's owned slice)
        assert g.dtype == torch.bfloat16 and torch.equal(g, ref_grads[name]), name
    for w, r in zip(weights, ref_weights):
        assert torch.equal(w, r)


_DISTOPT = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000
)


def _distopt_run(
    ps: ParallelState, overlap: bool, steps: int = 3
) -> tuple[list[float], torch.Tensor, list[int]]:
    """``steps`` steps of the distributed optimizer; (losses, final weights, broadcasts still in flight
    right after each step)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap,
        bucket_size=3000,
    )
    model = DistributedDataParallel(_model(ps).config, ddp_config, _model(ps), ps)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    losses, in_flight = [], []
    for step in range(steps):
        ids = _batches(ps.dp_rank, ps.dp_size)[step % MICRO]
        model.zero_grad_buffer()
        loss = model(ids, None, None, labels=ids).mean()
        if overlap and step > 0:
            assert not opt.param_sync.pending, "the forward pass waits for every weight it uses"
        loss.backward()
        finalize_model_grads([model])
        assert opt.step()[0]
        in_flight.append(len(opt.param_sync.pending))
        losses.append(loss.item())
    opt.finish_param_sync()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]), in_flight


@distributed_test(world_size=2)
def test_overlapped_param_broadcast_matches_waiting_at_the_step(ps: ParallelState) -> None:
    """--overlap-param-gather: the step returns with every bucket's all-gather in flight, the next
    forward waits for each layer's own buckets, and the run is bit-identical to waiting at the step."""
    import torch.distributed as dist

    losses, weights, in_flight = _distopt_run(ps, overlap=False)
    o_losses, o_weights, o_in_flight = _distopt_run(ps, overlap=True)
    assert in_flight == [0, 0, 0]
    n_buckets = len(DistributedDataParallel(_model(ps).config, _DISTOPT, _model(ps), ps).buckets)
    assert n_buckets > 2 and o_in_flight == [n_buckets] * 3  # one all-gather per bucket
    assert o_losses == losses
    assert torch.equal(o_weights, weights)
    gathered = [torch.empty_like(o_weights) for _ in range(2)]
    dist.all_gather(gathered, o_weights)
    assert torch.equal(gathered[0], gathered[1])


@distributed_test(world_size=2)
def test_bf16_gradient_reduction_keeps_bf16_buckets_and_matches_fp32_reduction(ps: ParallelState) -> None:
    """--grad-reduce-in-bf16: main grads live and are reduced in bf16 (half the bytes); they equal the
    fp32-reduced gradients up to bf16 rounding, and every replica steps to the same weights."""
    import torch.distributed as dist

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def run(fp32: bool):
        module = _bf16_model(ps)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=fp32, overlap_grad_reduce=True, bucket_size=3000
        )
        model = DistributedDataParallel(module.config, ddp_config, module, ps)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
        ids = _batches(ps.dp_rank, ps.dp_size)[0]
        model.zero_grad_buffer()
        model(ids, None, None, labels=ids).float().mean().backward()
        finalize_model_grads([model])
        dtypes = {b.dtype for b in model.buckets}
        grads = [p.main_grad.float().clone() for p in module.parameters()]
        assert opt.step()[0]
        return dtypes, grads, torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])

    dtypes16, grads16, weights16 = run(fp32=False)
    dtypes32, grads32, _ = run(fp32=True)
    assert dtypes16 == {torch.bfloat16} and dtypes32 == {torch.float32}
    for g16, g32 in zip(grads16, grads32):
        assert_close(g16, g32, rtol=2e-2, atol=1e-5)
    gathered = [torch.empty_like(weights16) for _ in range(2)]
    dist.all_gather(gathered, weights16)
    assert torch.equal(gathered[0], gathered[1])


STEP_LAYOUTS = {
    "fp32 reduction": dict(overlap_grad_reduce=True, bucket_size=3000),
    "bf16 reduction": dict(overlap_grad_reduce=True, bucket_size=3000, grad_reduce_in_fp32=False),
    "distributed optimizer": dict(
        overlap_grad_reduce=True, bucket_size=3000, use_distributed_optimizer=True, overlap_param_gather=True
    ),
}


@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
@distributed_test(world_size=2)
def test_a_training_step_makes_no_host_transfer(ps: ParallelState, layout: str) -> None:
    """Issue 6's "no host syncs inside the step": two micro-batches of forward and backward, the
    overlapped gradient reduction, the grad norm, clipping and the optimizer step (``sync=False``, as
    the training loop runs it) read nothing back and create no tensor from a host value except the
    optimizer's hyperparameters."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    module = _bf16_model(ps)
    model = DistributedDataParallel(
        module.config, DistributedDataParallelConfig(**STEP_LAYOUTS[layout]), module, ps
    )
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=1.0), [model])
    batches = _batches(ps.dp_rank, ps.dp_size)

    def step():
        model.zero_grad_buffer()
        opt.zero_grad()
        with model.no_sync():
            model(batches[0], None, None, labels=batches[0]).float().mean().backward()
        model(batches[1], None, None, labels=batches[1]).float().mean().backward()
        finalize_model_grads([model])
        return opt.step(sync=False)

    step()  # the first step allocates state
    with HostTransfers() as rec:
        success, grad_norm, _ = step()
    # The one transfer allowed: the step's learning rate and other AdamW hyperparameters, which on a GPU
    # go through pinned memory without blocking.
    assert set(rec.seen) == {("aten.lift_fresh.default", "megatron/core/optimizer/fused_adamw.py:_hyper")}
    assert success and torch.is_tensor(grad_norm) and float(grad_norm) > 0
    opt.finish_param_sync()


@pytest.mark.parametrize("compile_helpers", [True, False])
def test_gradient_copies_take_the_configured_compile_choice(monkeypatch, compile_helpers: bool) -> None:
    """The first gradient's copy and a later micro-batch's accumulation run compiled or eager as
    DistributedDataParallelConfig.compile_helpers says (the training application's execution plan)."""
    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    seen: set[tuple[str, bool]] = set()
    for name in ("_copy", "_accumulate"):
        real = getattr(ddp_mod, name)

        def recording(*args: torch.Tensor, compile: bool, _real=real, _name=name) -> None:
            seen.add((_name, compile))
            _real(*args, compile=compile)

        monkeypatch.setattr(ddp_mod, name, recording)
    solo = ParallelState(grid=RankGrid(), rank=0)
    module = _model(solo)
    config = DistributedDataParallelConfig(alias_single_gradients=False, compile_helpers=compile_helpers)
    model = DistributedDataParallel(module.config, config, module, solo)
    first, second = _batches(0, 1)
    with model.no_sync():
        model(first, None, None, labels=first).mean().backward()
    model(second, None, None, labels=second).mean().backward()
    assert seen == {("_copy", compile_helpers), ("_accumulate", compile_helpers)}
