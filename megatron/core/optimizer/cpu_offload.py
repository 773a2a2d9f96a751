"""Optimizer CPU offload: fp32 main params and optimizer state of some params in host memory.

``OptimizerConfig.optimizer_cpu_offload`` moves ``optimizer_offload_fraction`` of the optimized
params (by element count, :func:`select_offloaded`) to the host: their fp32 main param is a host
tensor, their optimizer state (Adam moments, SGD momentum) is created next to it, and their update
runs on the CPU. The other params stay on the device exactly as without offload.

The host main params stay in :class:`~megatron.core.optimizer.optimizer.MegatronOptimizer`'s inner
torch optimizer, which never steps them (their ``.grad`` stays None there): its param groups carry
the schedule's ``lr`` / ``weight_decay``, and its ``state`` holds their moments, so ``state_dict``
and the sharded checkpoint are the same keys and values as without offload. :class:`CpuOffload`
steps them chunk by chunk with torch optimizers of the same class over the host mains, sharing the
inner optimizer's ``state`` and copying its group hyper-parameters before every step.

One step of the offloaded params (after the gradient statistics, computed on the device over every
gradient, and after the device params' update was queued):

1. each chunk's gradients are copied device -> host into a (pinned) staging slot, in their own dtype;
2. the CPU steps the chunk (gradients widened to fp32 where needed, divided by the clipping divisor
   inside the step);
3. the updated params are cast to the model dtype into a (pinned) staging slot on the host and
   copied host -> device into the model params.

With ``overlap_cpu_optimizer_d2h_h2d`` on CUDA the copies are non-blocking on two side streams, with
two slots per direction: the gradients of chunk k+1 travel while the CPU steps chunk k, and the
params of chunk k travel back while it steps chunk k+1; the current stream waits for both side
streams before the step returns, so the next forward pass reads the updated params and the gradient
buffers are not zeroed under a copy. Without it (or on the CPU) the same sequence runs with blocking
copies. Host memory: 12 bytes per offloaded param for fp32 main param and Adam moments, plus the
slots (two chunks of gradients, two of params).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core.optimizer.clip_grads import step_with_divisor
from megatron.core.optimizer.optimizer_config import KERNEL_KEYS, OptimizerConfig

# A chunk holds whole params up to this many elements (more when one param alone is larger).
MAX_CHUNK_NUMEL = 1 << 26
# ... and at most a quarter of the offloaded elements, so that copies and the CPU step overlap.
_MIN_CHUNKS = 4
# Byte alignment of each tensor inside a staging slot.
_ALIGN = 64


def select_offloaded(params: Sequence[torch.Tensor], fraction: float) -> list[bool]:
    """Which of ``params`` (in order) are offloaded: each param that still fits, with the ones
    chosen before it, within ``fraction`` of all their elements (Megatron's rule). The same params
    on every rank that holds the same list."""
    budget = fraction * sum(p.numel() for p in params)
    chosen, used = [], 0
    for p in params:
        take = used + p.numel() <= budget
        used += p.numel() if take else 0
        chosen.append(take)
    return chosen


def _pinned(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def host_main_param(param: torch.Tensor, config: OptimizerConfig) -> torch.Tensor:
    """The fp32 host copy of ``param`` that the optimizer updates. An fp32 model copies it back
    from this tensor, so it is pinned (``pin_cpu_params``, CUDA only) in that case."""
    pin = config.pin_cpu_params and param.is_cuda and param.dtype == torch.float32
    main = _pinned(param.numel(), torch.float32, pin).view(param.shape)
    main.copy_(param.detach())
    return main


def host_kernel(config: OptimizerConfig) -> dict[str, bool]:
    """Kernel flags of the host optimizer: ``use_torch_optimizer_for_cpu_offload``: torch's own
    choice (no flags); AdamW with ``use_fused_adam``: ``fused`` (the fastest on the CPU,
    bench/bench_cpu_adam.py); SGD with it: ``foreach``; without ``use_fused_adam``: the
    single-tensor loop, as on the device."""
    if config.use_torch_optimizer_for_cpu_offload:
        return {}
    if not config.use_fused_adam:
        return {"foreach": False}
    return {"fused": True} if config.optimizer == "adam" else {"foreach": True}


@dataclass
class _Entry:
    """One offloaded param: its model tensor (on the device), host fp32 main, byte offsets into
    the chunk's slots."""

    model: torch.Tensor
    main: torch.Tensor
    grad_offset: int = 0
    param_offset: int = 0


@dataclass
class _Chunk:
    entries: list[_Entry]
    optimizer: torch.optim.Optimizer
    group_index: list[int]  # the inner optimizer's group of each of this optimizer's groups
    param_bytes: int  # bytes of the low-precision param copies in a slot
    stepped: list[_Entry] = field(default_factory=list)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Slots:
    """Two byte buffers per direction (pinned on request), reused chunk after chunk, with the
    event of the last copy that used each (CUDA only)."""

    def __init__(self, grad_bytes: int, param_bytes: int, pin_grads: bool, pin_params: bool) -> None:
        self.grads = [_pinned(grad_bytes, torch.uint8, pin_grads) for _ in range(2)]
        self.params = [_pinned(param_bytes, torch.uint8, pin_params) for _ in range(2)]
        self.param_events: list[torch.cuda.Event | None] = [None, None]


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    nbytes = like.numel() * dtype.itemsize
    return buf[offset : offset + nbytes].view(dtype).view(like.shape)


class CpuOffload:
    """Steps the offloaded params of ``inner`` on the host; see the module docstring.

    Args:
        config: the optimizer settings (kernel choice, overlap, pinning).
        inner: the optimizer's torch optimizer; its groups hold the host mains among the others.
        pairs: ``(model param, host fp32 main)`` of each offloaded param, in optimizer order.
        chunk_numel: most elements per chunk (default: ``MAX_CHUNK_NUMEL``, at most a quarter of the
            offloaded elements).
    """

    def __init__(
        self,
        config: OptimizerConfig,
        inner: torch.optim.Optimizer,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        chunk_numel: int | None = None,
    ) -> None:
        self.config = config
        self.inner = inner
        self.mains = {id(m) for _, m in pairs}
        self.numel = sum(m.numel() for _, m in pairs)
        if chunk_numel is None:
            chunk_numel = min(MAX_CHUNK_NUMEL, -(-self.numel // _MIN_CHUNKS))
        group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        self.chunks: list[_Chunk] = []
        current: list[_Entry] = []
        for model, main in pairs:
            current.append(_Entry(model, main))
            if sum(e.main.numel() for e in current) >= chunk_numel:
                self.chunks.append(self._chunk(current, group_of))
                current = []
        if current:
            self.chunks.append(self._chunk(current, group_of))
        self.on_cuda = any(m.is_cuda for m, _ in pairs)
        self.overlap = config.overlap_cpu_optimizer_d2h_h2d and self.on_cuda
        self._slots: _Slots | None = None
        self._grad_bytes = 0
        self._param_bytes = 0
        self._scratch: torch.Tensor | None = None
        self._divisor: torch.Tensor | None = None  # host copy of the clipping divisor
        self._use_divisor = False
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._grads: list[list[torch.Tensor | None]] = []
        self._grad_events: list[torch.cuda.Event | None] = []

    def _chunk(self, entries: list[_Entry], group_of: dict[int, int]) -> _Chunk:
        indices = sorted({group_of[id(e.main)] for e in entries})
        groups = []
        for i in indices:
            hyper = {k: v for k, v in self.inner.param_groups[i].items() if k not in ("params", *KERNEL_KEYS)}
            hyper["params"] = [e.main for e in entries if group_of[id(e.main)] == i]
            groups.append(hyper)
        cls: Any = type(self.inner)  # AdamW or SGD, as make_inner_optimizer builds
        optimizer: torch.optim.Optimizer = cls(groups, **host_kernel(self.config))
        param_offset = 0
        for e in entries:
            e.param_offset = param_offset
            if e.model.dtype != torch.float32:
                param_offset = _align(param_offset + e.main.numel() * e.model.dtype.itemsize)
        return _Chunk(entries, optimizer, indices, param_offset)

    def holds(self, main: torch.Tensor) -> bool:
        """True when ``main`` is one of the host main params stepped here."""
        return id(main) in self.mains

    # ---------------------------------------------------------------- device -> host
    def _ensure_slots(self, grads: list[list[torch.Tensor | None]]) -> None:
        """Lay out each chunk's gradients (in their dtype) in a slot; (re)allocate the slots when
        they are missing or too small."""
        grad_bytes = 0
        for chunk, chunk_grads in zip(self.chunks, grads):
            offset = 0
            for e, g in zip(chunk.entries, chunk_grads):
                e.grad_offset = offset
                if g is not None:
                    offset = _align(offset + g.numel() * g.element_size())
            grad_bytes = max(grad_bytes, offset)
        param_bytes = max((c.param_bytes for c in self.chunks), default=0)
        if self._slots is None or grad_bytes > self._grad_bytes or param_bytes > self._param_bytes:
            self._grad_bytes = max(grad_bytes, self._grad_bytes)
            self._param_bytes = max(param_bytes, self._param_bytes)
            pin_grads = self.config.pin_cpu_grads and self.on_cuda
            pin_params = self.config.pin_cpu_params and self.on_cuda
            self._slots = _Slots(self._grad_bytes, self._param_bytes, pin_grads, pin_params)
        if self._d2h is None and self.overlap:
            self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()

    @torch.no_grad()
    def start_grad_copies(self, grads: Sequence[torch.Tensor | None], divisor: torch.Tensor | None) -> None:
        """Queue the offloaded gradients' copies to the host (the first two chunks; the others
        follow as slots free up in :meth:`step`).

        Args:
            grads: each offloaded param's gradient (any float dtype, on the device) or None, in the
                order of the ``pairs`` given at construction. They must stay unchanged until
                :meth:`step` returns.
            divisor: 0-dim device tensor the gradients are divided by (clipping), or None.
        """
        it = iter(grads)
        self._grads = [[next(it) for _ in chunk.entries] for chunk in self.chunks]
        self._ensure_slots(self._grads)
        self._grad_events = [None] * len(self.chunks)
        if self._d2h is not None and self._h2d is not None:
            # Backward and the statistics are queued before this point: once the copies start, no
            # earlier kernel still reads the gradients' final values or the model params.
            ready = torch.cuda.current_stream().record_event()
            self._d2h.wait_event(ready)
            self._h2d.wait_event(ready)
        with self._on(self._d2h):
            self._use_divisor = divisor is not None
            if divisor is not None:
                if self._divisor is None:
                    self._divisor = _pinned(1, torch.float32, self.on_cuda).view(())
                self._divisor.copy_(divisor.detach(), non_blocking=self.overlap)
            for k in range(min(2, len(self.chunks))):
                self._copy_grads(k)

    def _on(self, stream: torch.cuda.Stream | None) -> torch.cuda.StreamContext | _NoStream:
        return torch.cuda.stream(stream) if stream is not None else _NoStream()

    def _copy_grads(self, k: int) -> None:
        """Copy chunk ``k``'s gradients into slot ``k % 2`` (on the current stream)."""
        assert self._slots is not None
        slot = self._slots.grads[k % 2]
        for e, g in zip(self.chunks[k].entries, self._grads[k]):
            if g is None:
                continue
            _view(slot, e.grad_offset, e.main, g.dtype).copy_(g.view(e.main.shape), non_blocking=self.overlap)
            if self._d2h is not None:
                g.record_stream(self._d2h)
        if self.overlap:
            self._grad_events[k] = torch.cuda.current_stream().record_event()

    # ---------------------------------------------------------------- CPU step, host -> device
    @torch.no_grad()
    def step(self) -> None:
        """Step every chunk on the CPU and copy its params back into the model (see module docstring)."""
        assert self._slots is not None, "start_grad_copies() first"
        for k, chunk in enumerate(self.chunks):
            event = self._grad_events[k]
            if event is not None:
                event.synchronize()
            self._step_chunk(k, chunk)
            if k + 2 < len(self.chunks):
                with self._on(self._d2h):
                    self._copy_grads(k + 2)
            self._copy_params_back(k, chunk)
        if self._d2h is not None and self._h2d is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._d2h)
            current.wait_stream(self._h2d)
        self._grads = []

    def _step_chunk(self, k: int, chunk: _Chunk) -> None:
        assert self._slots is not None
        slot = self._slots.grads[k % 2]
        chunk.stepped = []
        widened = [
            e for e, g in zip(chunk.entries, self._grads[k]) if g is not None and g.dtype != torch.float32
        ]
        scratch = self._scratch_for(sum(e.main.numel() for e in widened))
        offset = 0
        for e, g in zip(chunk.entries, self._grads[k]):
            if g is None:
                e.main.grad = None
                continue
            host = _view(slot, e.grad_offset, e.main, g.dtype)
            if g.dtype != torch.float32:
                wide = scratch[offset : offset + e.main.numel()].view(e.main.shape)
                offset += e.main.numel()
                host = wide.copy_(host)
            e.main.grad = host
            chunk.stepped.append(e)
        if not chunk.stepped:
            return
        self._sync_hyper(chunk)
        optimizer = chunk.optimizer
        optimizer.state = self.inner.state  # one state: checkpoints read the inner optimizer's
        divisor = self._divisor if self._use_divisor else None
        try:
            step_with_divisor(optimizer, [e.main.grad for e in chunk.stepped], divisor)
        finally:
            for e in chunk.entries:
                e.main.grad = None

    def _scratch_for(self, numel: int) -> torch.Tensor:
        """An fp32 host buffer of at least ``numel`` elements for widening low-precision gradients."""
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.float32)
        return self._scratch

    def _sync_hyper(self, chunk: _Chunk) -> None:
        """Copy the inner groups' hyper-parameters (the schedule's lr and weight decay among them)."""
        for group, index in zip(chunk.optimizer.param_groups, chunk.group_index):
            source = self.inner.param_groups[index]
            group.update({k: v for k, v in source.items() if k not in ("params", *KERNEL_KEYS)})

    def _copy_params_back(self, k: int, chunk: _Chunk) -> None:
        """Copy chunk ``k``'s updated params into the model (through slot ``k % 2`` when the model
        dtype is not fp32)."""
        if not chunk.stepped:
            return
        assert self._slots is not None
        slot = self._slots.params[k % 2]
        event = self._slots.param_events[k % 2]
        if event is not None:
            event.synchronize()  # the slot's previous copy has left
        with self._on(self._h2d):
            for e in chunk.stepped:
                if e.model.dtype == torch.float32:
                    source = e.main
                else:
                    source = _view(slot, e.param_offset, e.main, e.model.dtype).copy_(e.main)
                e.model.copy_(source, non_blocking=self.overlap)
            if self.overlap:
                self._slots.param_events[k % 2] = torch.cuda.current_stream().record_event()

    # ---------------------------------------------------------------- other
    @torch.no_grad()
    def reload_from_model(self) -> None:
        """Copy the model params into the host mains (after loading model weights only)."""
        for chunk in self.chunks:
            for e in chunk.entries:
                e.main.copy_(e.model.detach())

    def describe(self) -> str:
        """One line for the start-up log: what is offloaded, how it is stepped and copied."""
        kernel = host_kernel(self.config) or {"torch default": True}
        copies = "overlapped on side streams" if self.overlap else "blocking"
        return (
            f"optimizer CPU offload: {sum(len(c.entries) for c in self.chunks)} tensors "
            f"({self.numel} elements) with fp32 main params and state in host memory, stepped on the CPU "
            f"in {len(self.chunks)} chunks by {type(self.inner).__name__}({', '.join(kernel)}); copies {copies}"
        )

    def host_bytes(self) -> int:
        """Bytes of host memory held for the offloaded params: mains, optimizer state, slots."""
        total = sum(e.main.numel() * 4 for c in self.chunks for e in c.entries)
        for c in self.chunks:
            for e in c.entries:
                for v in self.inner.state.get(e.main, {}).values():
                    if torch.is_tensor(v) and not v.is_cuda:
                        total += v.numel() * v.element_size()
        if self._slots is not None:
            total += 2 * (self._grad_bytes + self._param_bytes)
        return total


class _NoStream:
    """Stand-in for ``torch.cuda.stream(...)`` when the copies run on the current stream."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
