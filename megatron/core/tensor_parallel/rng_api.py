"""Megatron-Core's RNG and recompute entry points, as adapters over :mod:`rng_states`'s tracker.

Megatron-Core keeps one module-global tracker; here the tracker lives on the default ParallelState
(``rng_tracker``), where models built from the default state find it. Before
``initialize_model_parallel`` a tracker not yet bound to a state is handed out (the runtime's
``layout.unbound_rng_tracker``), and the next ``model_parallel_cuda_manual_seed`` fills and binds
that same object. ``destroy_model_parallel`` forgets an unbound tracker with the rest of the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_grid import ParallelState
from megatron.core.parallel_state_init import get_parallel_state, model_parallel_is_initialized
from megatron.core.runtime import get_runtime
from megatron.core.tensor_parallel.rng_states import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_seed,
)


def _dropout_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _refuse(**flags: bool) -> None:
    for name, value in flags.items():
        if value:
            raise ConfigError(
                f"{name}=True needs a tracker this package does not have (Transformer Engine / "
                f"CUDA graphs); call it with {name}=False",
                params=(name,),
            )


class CudaRNGStatesTracker(RNGStatesTracker):
    """Megatron-Core's tracker class: the named states of the device dropout runs on (the current
    CUDA device when CUDA is available, else the CPU, whose default generator ``fork`` swaps).

    Args:
        use_cudagraphable_rng: CUDA-graph-safe states; not provided (must be False).
        is_inference_rng_tracker: ``add`` and ``set_states`` do nothing and ``fork`` is a no-op, so
            code under ``fork`` draws from the default generator.

    Raises:
        ValueError: ``use_cudagraphable_rng`` is True.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        _refuse(use_cudagraphable_rng=use_cudagraphable_rng)
        super().__init__(_dropout_device())
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def add(self, name: str, seed: int) -> None:
        if not self.is_inference_rng_tracker:
            super().add(name, seed)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if not self.is_inference_rng_tracker:
            super().set_states(states)

    def fork(self, name: str = MODEL_PARALLEL_RNG) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        if self.is_inference_rng_tracker:
            return contextlib.nullcontext()
        return super().fork(name)


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> RNGStatesTracker:
    """The tracker ``model_parallel_cuda_manual_seed`` filled: the default ParallelState's
    ``rng_tracker``; before any seeding an empty :class:`CudaRNGStatesTracker` (the same object on
    every call, the one the next seeding fills).

    Raises:
        ConfigError: ``use_te_rng_tracker`` or ``use_cudagraphable_rng`` is True.
    """
    _refuse(use_te_rng_tracker=use_te_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng)
    one_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    if model_parallel_is_initialized() or one_rank:
        bound: RNGStatesTracker | None = get_parallel_state().rng_tracker
        if bound is not None:
            return bound
    layout = get_runtime().layout
    if layout.unbound_rng_tracker is None:
        layout.unbound_rng_tracker = CudaRNGStatesTracker(is_inference_rng_tracker=inference_rng_tracker)
    return layout.unbound_rng_tracker


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
    *,
    parallel_state: ParallelState | None = None,
) -> RNGStatesTracker:
    """Megatron-Core's seeding entry point (call it after ``initialize_model_parallel``).

    Seeds the default generator of the device dropout runs on (the current CUDA device, else the
    CPU, which also sets ``torch.initial_seed()`` that ``GPTModel`` initialises from) with ``seed``,
    alike on every tp rank, and fills the tracker with Megatron's states:
    ``"data-parallel-rng"`` = ``seed``, ``"model-parallel-rng"`` = ``seed + 2718 + tp_rank``,
    ``"expert-parallel-rng"`` = ``seed + 1024 + 100 * ep_rank + etp_rank``. The tracker (the one
    :func:`get_cuda_rng_tracker` returned, reset; a new one with ``force_reset_rng``) becomes
    ``parallel_state.rng_tracker``, which models built on that state afterwards hand to their dropout.

    Args:
        seed: the seed.
        tp_rank / ep_rank / etp_rank: default this rank's (etp: the tp rank, as Megatron's expert
            tp size defaults to the tp size).
        inference_rng_tracker: a tracker whose ``fork`` is a no-op (see :class:`CudaRNGStatesTracker`).
        parallel_state: the state to seed for (ours); default the default ParallelState.

    Returns:
        The filled tracker (Megatron-Core returns None).

    Raises:
        ConfigError: ``te_rng_tracker`` or ``use_cudagraphable_rng`` is True.
    """
    _refuse(te_rng_tracker=te_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng)
    if parallel_state is None:
        parallel_state = get_parallel_state()
    layout = get_runtime().layout
    tracker: RNGStatesTracker | None = None if force_reset_rng else parallel_state.rng_tracker
    if not isinstance(tracker, CudaRNGStatesTracker):
        unbound = None if force_reset_rng else layout.unbound_rng_tracker
        if unbound is None:
            unbound = CudaRNGStatesTracker(is_inference_rng_tracker=inference_rng_tracker)
        tracker = unbound
    layout.unbound_rng_tracker = None
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    model_parallel_seed(
        seed,
        parallel_state.tp_rank if tp_rank is None else tp_rank,
        parallel_state.axis_rank("ep") if ep_rank is None else ep_rank,
        getattr(parallel_state, "etp_rank", None) if etp_rank is None else etp_rank,
        tracker=tracker,
    )
    parallel_state.rng_tracker = tracker
    return tracker


def get_data_parallel_rng_tracker_name() -> str:
    """``"data-parallel-rng"``: the state seeded with the seed itself."""
    return DATA_PARALLEL_RNG


def get_expert_parallel_rng_tracker_name() -> str:
    """``"expert-parallel-rng"``: the state of expert layers."""
    return EXPERT_PARALLEL_RNG


def get_all_rng_states() -> dict[str, torch.Tensor]:
    """The named states of :func:`get_cuda_rng_tracker` (copies)."""
    return get_cuda_rng_tracker().get_states()


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: Any) -> bool:
    """Always False: no tracker here is CUDA-graph safe."""
    return False


# -- RNG capture and replay for the recompute functions below ----------------------------------------

RngSnapshot = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


def capture_rng(tracker: RNGStatesTracker) -> RngSnapshot:
    """The CPU and current CUDA generators' states and ``tracker``'s named states."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tracker.get_states()


def _restore(snapshot: RngSnapshot, tracker: RNGStatesTracker) -> None:
    cpu, cuda, named = snapshot
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    tracker.set_states(named)


@contextlib.contextmanager
def replaying_rng(snapshot: RngSnapshot, tracker: RNGStatesTracker) -> Iterator[None]:
    """Run the block with every generator as ``snapshot`` recorded; afterwards they continue as
    they were before the block."""
    now = capture_rng(tracker)
    _restore(snapshot, tracker)
    try:
        yield
    finally:
        _restore(now, tracker)


def detached_like(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Tensors detached (keeping ``requires_grad``) so a recompute builds its own graph."""
    return tuple(
        a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
    )


def grads_of(outputs: Any, grads: tuple[torch.Tensor, ...], inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Backpropagate ``grads`` through the recomputed ``outputs``; the inputs' gradients."""
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return tuple(a.grad if isinstance(a, torch.Tensor) else None for a in inputs)


def callable_name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", type(function).__name__)
