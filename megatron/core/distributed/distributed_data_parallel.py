"""Data-parallel wrapper: contiguous main-gradient buffer, buckets, overlapped reduction.

Every trainable parameter gets ``param.main_grad``, a view into its bucket's contiguous buffer (fp32
when ``grad_reduce_in_fp32``), allocated (uninitialised) at the bucket's first gradient of a step and
released when the next step starts. A post-accumulate hook copies a parameter's first gradient of
the step into it (no zero fill, no read of zeros), adds later ones (gradient accumulation) and frees
``param.grad``, so gradients accumulate across micro-batches in full precision whatever the
parameter dtype. ``finish_grad_sync`` (called by ``finalize_model_grads``) zeroes the slices of
parameters that got no gradient; call it before reading ``main_grad``.

With ``alias_single_gradients``, a parameter whose gradient is not summed across ranks later (not
a sequence-parallel or pipeline-tied one) keeps its first gradient of the step as ``main_grad`` as
is: no bucket memory and no copy. Without data-parallel reduction (one DP rank) that holds for any
bucket dtype: the optimizer reads the gradient in fp32, which is exact (a bf16 value widens to fp32
without rounding). With data-parallel reduction it holds where the parameter's dtype is the bucket's
(``--grad-reduce-in-bf16`` with bf16 params, or fp32 params): a bucket whose gradients are all
aliased is reduced tensor by tensor, in place, instead of being copied into contiguous storage first
(what the copy costs: docs/performance.md, "Weak scaling, llama-3b"). A second micro-batch's
gradient moves the first into the bucket's storage and accumulates there, so gradient accumulation
still sums in the bucket's dtype and the bucket is reduced as one tensor.

Parameters are laid out in reverse registration order (roughly the order backward produces their
gradients) and cut into buckets of about ``bucket_size`` elements. With ``overlap_grad_reduce``,
during the backward of the last micro-batch (outside ``no_sync``) a bucket's asynchronous
all-reduce starts as soon as its last gradient has been accumulated, overlapping communication
with the rest of backward; ``finish_grad_sync`` waits for them (and reduces any bucket whose
parameters got no gradient). Without overlap, everything is reduced in ``finish_grad_sync``.

With ``use_distributed_optimizer`` (and more than one rank in some bucket's group) the buckets take
Megatron's layout (:mod:`.param_and_grad_buffer`): params aligned to 64 elements, each bucket padded
to a multiple of lcm(DP, 128), one param dtype per bucket and a pipeline-tied embedding in a bucket
of its own; each bucket is reduce-scattered (DP rank r keeps the slice [r*len/DP, (r+1)*len/DP) of
the sum, the only part ``owned_main_grad`` and the optimizer read), no gradient is aliased, and the
model params become views into ``param_buffers``, which the distributed optimizer all-gathers after
its step.

Expert parameters (``moe.expert_params``: ``allreduce = False``) live in buckets of their own,
reduced over the expert-data-parallel group (the ranks holding the same expert shard) instead of
dp x cp; with the distributed optimizer they are sharded over it. Their net scale is the dense one,
1/(dp x cp): an expert's gradient on one rank already sums the contributions of every token routed
to it from its expert-parallel peers, so the sum over expert-dp covers every dp x cp rank's loss
once (Megatron-Core's ``expert_gradient_scaling_factor``). A bucket whose group has one rank is still
scaled where that factor is not 1 (ep = dp x cp: no expert-dp peers, the tokens of dp x cp ranks).

Process groups: the constructor takes a ``ParallelState`` (``parallel_state=``); only when none is
given does it read the default one that ``initialize_model_parallel`` recorded (DDP is a
Megatron-Core entry point). Nothing below the constructor reads the default.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import (  # noqa: F401 - bucket_* re-exported
    NO_REDUCTION,
    ParamBuffer,
    ReduceDomain,
    bucket_layout,
    bucket_lengths,
    bucket_size,
    shard_range,
)
from megatron.core.fusions.compile import maybe_compiled
from megatron.core.parallel_state import ParallelState, get_parallel_state
from megatron.core.transformer.moe.expert_params import is_expert_param

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def _add_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    acc.add_(grad)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


# Compiled on CUDA: one vectorised kernel for the fp32 += bf16 accumulation and the bf16 -> fp32
# first-gradient copy, whose eager mixed-dtype kernels run below the copy bandwidth (docs/performance.md,
# "Two H200s: llama-3b (jobs 2-5)").
_accumulate = maybe_compiled(_add_into, dynamic=True)
_copy = maybe_compiled(_copy_into, dynamic=True)


def _rank_in(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


class _Bucket:
    """A contiguous fp32 (or param-dtype) gradient slice and the parameters whose ``main_grad`` live in it.

    The storage exists only from the first gradient of a step that needs it until ``release`` (start
    of the next step), so at the start of backward, when every activation is still alive, no gradient
    memory is held yet: buckets appear one by one as backward frees activations. Parameters in
    ``aliasable`` keep a single gradient as their ``main_grad`` without any storage.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        aliasable: frozenset[int] = frozenset(),
        compile_helpers: bool = True,
        layout: tuple[list[int], int] | None = None,
        domain: ReduceDomain = NO_REDUCTION,
    ) -> None:
        self.params = params
        self.domain = domain
        self.dtype, self.device = dtype, device
        self.aliasable = aliasable
        self.compile_helpers = compile_helpers
        # (start of each param, length): packed, or the distributed optimizer's aligned, padded layout.
        packed = list(itertools.accumulate((p.numel() for p in params), initial=0))
        starts, self.numel = layout or (packed[:-1], packed[-1])
        self.offsets = {id(p): start for p, start in zip(params, starts)}
        ends = [start + p.numel() for p, start in zip(params, starts)]
        self.gaps = [(a, b) for a, b in zip([0, *ends], [*starts, self.numel]) if a < b]  # padding
        self.view: torch.Tensor | None = None
        self.written: set[int] = set()  # params whose main_grad holds this step's gradient
        self.aliased: set[int] = set()  # ... as the gradient tensor itself (no storage)
        self.ready: set[int] = set()
        self.handle: Any = None  # the list of async work handles of its reduction, once started

    def _slice(self, param: torch.Tensor) -> torch.Tensor:
        start = self.offsets[id(param)]
        return self.allocate()[start : start + param.numel()].view_as(param)

    def allocate(self) -> torch.Tensor:
        """The bucket's storage; slices of params not yet written this step are uninitialised.
        Params holding an aliased gradient keep it (``_to_storage`` moves it in)."""
        if self.view is None:
            self.view = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            for a, b in self.gaps:
                self.view[a:b].zero_()
            for p in self.params:
                if id(p) not in self.aliased:
                    p.main_grad = self._slice(p)  # type: ignore[attr-defined]
        return self.view

    def _to_storage(self, param: torch.Tensor) -> None:
        """Move an aliased gradient into the bucket's storage (widening it to the bucket dtype)."""
        grad = param.main_grad  # type: ignore[attr-defined]
        self.aliased.discard(id(param))
        param.main_grad = self._slice(param)  # type: ignore[attr-defined]
        param.main_grad.copy_(grad)  # type: ignore[attr-defined]

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """First gradient of the step: keep it (aliasable params) or copy it; later micro-batches: add."""
        key = id(param)
        if key in self.aliased:
            self._to_storage(param)
        if key in self.written:
            _accumulate(
                param.main_grad.view(-1),  # type: ignore[attr-defined]
                grad.view(-1),
                compile=self.compile_helpers,
            )
            return
        self.written.add(key)
        if key in self.aliasable and grad.is_contiguous():  # (a collective reduces contiguous tensors only)
            param.main_grad = grad  # type: ignore[attr-defined]
            self.aliased.add(key)
            return
        self.allocate()
        if grad.is_contiguous():
            _copy(param.main_grad.view(-1), grad.view(-1), compile=self.compile_helpers)  # type: ignore[attr-defined]
        else:
            param.main_grad.copy_(grad)  # type: ignore[attr-defined]

    def finish(self) -> None:
        """Every param gets a ``main_grad`` (zeros where it got no gradient this step); aliased
        gradients stay aliased and no storage is created for them."""
        for p in self.params:
            if id(p) in self.written:
                continue
            self.written.add(id(p))
            if self.view is None and id(p) in self.aliasable:
                p.main_grad = torch.zeros_like(p)  # type: ignore[attr-defined]
                self.aliased.add(id(p))
            else:
                self.allocate()
                p.main_grad.zero_()  # type: ignore[attr-defined]

    def materialize(self) -> torch.Tensor:
        """The storage, holding every param's gradient (zeros for params that got none this step)."""
        self.finish()
        for p in self.params:
            if id(p) in self.aliased:
                self._to_storage(p)
        return self.allocate()

    def release(self) -> None:
        self.view = None
        for p in self.params:
            p.main_grad = None  # type: ignore[attr-defined]
        self.written.clear()
        self.aliased.clear()
        self.ready.clear()
        self.handle = None


class DistributedDataParallel(nn.Module):
    """Wraps ``module``; ``forward`` is the module's. Megatron-Core's constructor signature."""

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The word embedding / output-layer weight this chunk ties to another stage's copy, or None."""
        return self._tied[0] if self._tied else None

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        parallel_state: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        # With check_local_grads, each step's per-parameter gradient norms before any reduction, per
        # bucket: [(params, fp32 norms)] (a device tensor each, no host sync), so that a NaN/Inf
        # gradient can be traced to the rank and parameter it arose in. A new list every step.
        self.check_local_grads = False
        self.local_grad_norms: list[tuple[list[nn.Parameter], torch.Tensor]] = []
        self.pg = parallel_state if parallel_state is not None else get_parallel_state()
        self.dp_group = self.pg.dp_cp_group
        self.dp_size = self.pg.dp_size * self.pg.cp_size
        self.expt_dp_group = self.pg.groups.get("expt_dp")
        self.expt_dp_size = self.pg.expt_dp_size
        # Gradients are averaged over dp x cp (with per-token loss finalize_model_grads re-scales
        # them by dp x cp / tokens): expert ones too, summed over expert-dp (module docstring).
        self.dense_domain = ReduceDomain(self.dp_group, self.dp_size, _rank_in(self.dp_group), self.dp_size)
        self.expert_domain = ReduceDomain(
            self.expt_dp_group, self.expt_dp_size, _rank_in(self.expt_dp_group), self.dp_size
        )
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        grad_dtype = (
            torch.float32
            if ddp_config.grad_reduce_in_fp32
            else (params[0].dtype if params else torch.float32)
        )
        # The word embedding / output-layer weight this chunk ties to another pipeline stage's copy
        # (None when the model does not tie them); finalize_model_grads sums its gradient over both.
        tied_weight = getattr(module, "shared_embedding_or_output_weight", None)
        share = bool(getattr(module, "share_embeddings_and_output_weights", False))
        # Held in a tuple: an nn.Parameter attribute would register it as this wrapper's parameter
        # ("tied_weight"), renaming it for the optimizer's groups and checkpoints.
        self._tied: tuple[torch.Tensor, ...] = (tied_weight(),) if share and callable(tied_weight) else ()
        experts = {id(p) for p in params if is_expert_param(p)}
        self.has_expert_params = bool(experts)

        def domain_of(p: torch.Tensor) -> ReduceDomain:
            return self.expert_domain if id(p) in experts else self.dense_domain

        aliasable: frozenset[int] = frozenset()
        # --use-distributed-optimizer: Megatron's bucket-sharded layout (param_and_grad_buffer.py).
        # Each bucket's gradients are reduce-scattered from its contiguous storage: none is aliased.
        sizes = {self.dense_domain.size} | ({self.expert_domain.size} if experts else set())
        self.distributed_optimizer = ddp_config.use_distributed_optimizer and max(sizes) > 1
        if ddp_config.alias_single_gradients and not self.distributed_optimizer:
            # Gradients summed across ranks after backward (finalize_model_grads) need the storage;
            # reduced (or scaled) in place, a gradient must already be in the dtype it is reduced in.
            tied = self.tied_weight if self.pg.pp_size > 1 else None
            aliasable = frozenset(
                id(p)
                for p in params
                if not getattr(p, "sequence_parallel", False)
                and p is not tied
                and (domain_of(p).trivial or p.dtype == grad_dtype)
            )
        ordered = list(reversed(params))
        self.buckets = self._make_buckets(
            [p for p in ordered if id(p) not in experts], grad_dtype, device, aliasable, self.dense_domain
        ) + self._make_buckets(
            [p for p in ordered if id(p) in experts], grad_dtype, device, aliasable, self.expert_domain
        )
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # The distributed optimizer's parameter buffers, one per bucket (model params become views
        # into them), each sharded over its bucket's group; empty without it.
        self.param_buffers: list[ParamBuffer] = []
        if self.distributed_optimizer:
            self.param_buffers = [
                ParamBuffer(
                    b.params,
                    [b.offsets[id(p)] for p in b.params],
                    b.numel,
                    b.domain.size,
                    b.domain.rank,
                    group=b.domain.group,
                )
                for b in self.buckets
            ]
        self._piece_of = {id(piece.param): piece for b in self.param_buffers for piece in b.pieces}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._sync_enabled = True

    def _make_buckets(
        self,
        params: list[nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        aliasable: frozenset[int],
        domain: ReduceDomain,
    ) -> list[_Bucket]:
        if not params:
            return []
        limit = bucket_size(self.ddp_config, domain.size)

        def cut(ordered: list[nn.Parameter]) -> list[list[nn.Parameter]]:
            groups, start = [], 0
            for length in bucket_lengths([p.numel() for p in ordered], limit):
                groups.append(ordered[start : start + length])
                start += length
            return groups

        if self.distributed_optimizer:
            # One param dtype per bucket (its parameter buffer), and a tied embedding alone, so that
            # both pipeline stages holding it lay it out, and shard it, alike.
            tied = self.tied_weight if self.pg.pp_size > 1 else None
            groups = [[p] for p in params if p is tied]
            for param_dtype in dict.fromkeys(p.dtype for p in params):
                groups += cut([p for p in params if p.dtype == param_dtype and p is not tied])
        elif not domain.trivial and aliasable:
            # A bucket reduced in place needs every gradient aliased: keep the others (sequence-
            # parallel norms, a tied embedding) in buckets of their own.
            groups = cut([p for p in params if id(p) in aliasable]) + cut(
                [p for p in params if id(p) not in aliasable]
            )
        else:
            groups = cut(params)
        return [
            _Bucket(
                g,
                dtype,
                device,
                frozenset(id(p) for p in g) & aliasable,
                self.ddp_config.compile_helpers,
                bucket_layout([p.numel() for p in g], domain.size) if self.distributed_optimizer else None,
                domain,
            )
            for g in groups
        ]

    def _dp_rank(self) -> int:
        """This rank's index in the data-parallel (x context-parallel) group."""
        return self.dense_domain.rank

    @property
    def grad_buffer(self) -> torch.Tensor:
        """All gradients as one flat tensor (a copy), in bucket order; allocates missing buckets."""
        return torch.cat([b.materialize() for b in self.buckets])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        assert param.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
        bucket.accumulate(param, param.grad)
        param.grad = None
        if not (self._sync_enabled and self.ddp_config.overlap_grad_reduce and not bucket.domain.trivial):
            return
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and bucket.handle is None:
            self._start_reduce(bucket, async_op=True)

    @staticmethod
    def _average_op(
        views: list[torch.Tensor], domain: ReduceDomain, in_collective: bool
    ) -> dist.ReduceOp.RedOpType:
        """The reduce op that leaves ``views`` divided by ``domain.divisor`` once summed over its group,
        pre-scaling them here where the collective cannot.

        NCCL's own average, not torch's ``_make_nccl_premul_sum``: for bf16 buffers torch 2.11 hands
        NCCL the factor as a 4-byte float where NCCL reads 2 bytes, so 1/2 arrives as 0 and every
        gradient as zero (pytorch/pytorch#190745; tests/distributed/test_ddp.py's bf16 reduction on NCCL).
        ``in_collective`` (``--ddp-average-in-collective``) averages in the collective on any backend.
        """
        nccl = domain.size > 1 and dist.get_backend(domain.group) == "nccl"
        if in_collective or nccl:
            # AVG divides by the group size: pre-scale by what remains (1 for dense buckets; for
            # expert ones expert-dp / (dp x cp), Megatron-Core's expert_gradient_scaling_factor).
            if domain.size != domain.divisor:
                torch._foreach_mul_(views, domain.size / domain.divisor)
            return dist.ReduceOp.AVG
        torch._foreach_mul_(views, 1.0 / domain.divisor)
        return dist.ReduceOp.SUM

    def _note_local_norms(self, bucket: _Bucket) -> None:
        if self.check_local_grads and bucket.params:
            grads = [p.main_grad for p in bucket.params]  # type: ignore[attr-defined]
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            self.local_grad_norms.append((bucket.params, torch.stack(norms)))

    def _start_reduce(self, bucket: _Bucket, async_op: bool) -> None:
        bucket.finish()
        self._note_local_norms(bucket)
        # Every gradient of the bucket aliased (one micro-batch): reduce them where they are, no copy.
        tensors = (
            [p.main_grad for p in bucket.params]  # type: ignore[attr-defined]
            if bucket.view is None
            else [bucket.materialize()]
        )
        domain = bucket.domain
        if domain.size == 1:  # scaled only (an expert bucket without expert-dp peers)
            if domain.divisor != 1:
                torch._foreach_mul_(tensors, 1.0 / domain.divisor)
            bucket.handle = []
            return
        op = self._average_op(tensors, domain, self.ddp_config.average_in_collective)
        if self.distributed_optimizer:
            # Only this rank's slice of the sum is needed: reduce-scattered into the bucket in place.
            lo, hi = shard_range(bucket.numel, domain.size, domain.rank)
            storage = tensors[0]
            bucket.handle = [
                dist.reduce_scatter_tensor(
                    storage[lo:hi], storage, op=op, group=domain.group, async_op=async_op
                )
            ]
            return
        bucket.handle = [dist.all_reduce(t, op=op, group=domain.group, async_op=async_op) for t in tensors]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Defer gradient reduction (all micro-batches but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad_buffer(self) -> None:
        """Start a step: gradient memory is returned and re-created (zeroed) by the next backward."""
        for bucket in self.buckets:
            bucket.release()
        for p in self.module.parameters():
            p.grad = None
        self.local_grad_norms = []

    def finish_grad_sync(self) -> None:
        """Wait for the buckets reduced during backward; reduce the others now. Afterwards every
        parameter has a ``main_grad`` (zeros where it got no gradient this step); without
        data-parallel reduction aliased gradients stay in the parameter dtype."""
        for bucket in self.buckets:
            if bucket.domain.trivial:
                bucket.finish()
                self._note_local_norms(bucket)
            elif bucket.handle is None:
                self._start_reduce(bucket, async_op=True)
        for bucket in self.buckets:
            for handle in bucket.handle or ():
                if handle is not None:
                    handle.wait()
            bucket.handle = None
            bucket.ready.clear()

    def owned_main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param.main_grad`` after ``finish_grad_sync``, flat: the elements this rank owns under the
        distributed optimizer (the only ones reduced), else all of it."""
        grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
        if not self.distributed_optimizer:
            return grad
        piece = self._piece_of.get(id(param))  # None: this rank owns no element of it
        return grad.view(-1)[piece.start : piece.stop] if piece is not None else grad.view(-1)[:0]

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        for bucket in self.buckets:
            bucket.finish()
            if bucket.view is None and all(p.dtype == bucket.dtype for p in bucket.params):
                for p in bucket.params:  # aliased in the bucket's dtype: the same rounding in place
                    p.main_grad.mul_(factor)  # type: ignore[attr-defined]
            else:
                bucket.materialize().mul_(factor)

    # Checkpointing and attribute access go to the wrapped module.
    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        return self.module.sharded_state_dict(prefix, *args, **kwargs)  # type: ignore[operator]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)
