"""Named RNG states for tensor-parallel regions, and activation checkpointing that replays them.

(``megatron.core.tensor_parallel.random`` is Megatron-Core's public module of these names and of
the entry points over the default tracker; this module holds the tracker itself.)

Megatron's convention (reference 7.8): the default generator is seeded alike on every tp rank, so
dropout on *replicated* activations (the hidden states without sequence parallelism) draws the
same mask on every tp rank, as it must. Inside a tensor-parallel region (attention dropout on this
rank's heads; with sequence parallelism the hidden dropout on this rank's sequence shard) the
ranks hold different data and must draw different masks: that code runs under
``tracker.fork()``, which swaps the named state ``"model-parallel-rng"`` (seeded
``seed + 2718 + tp_rank``) into the device's default generator and swaps it back afterwards.

The tracker is an object, not a module global: whoever builds the model creates it with
``model_parallel_seed`` and passes it down to the modules that need it (library code calls
``checkpoint_with_rng(..., tracker=)``). Megatron-Core's entry points (``model_parallel_cuda_manual_seed``,
``get_cuda_rng_tracker``, ``checkpoint(function, distribute_saved_activations, *args)``,
``CheckpointWithoutOutput``) read and fill the default ParallelState's ``rng_tracker``, the one
models built from the default state hand to their dropout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

# Megatron-Core's names of the tracker's states.
MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"


class RNGStatesTracker:
    """A set of named generator states for one device type, swapped in by ``fork(name)``.

    Args:
        device: the device whose default generator ``fork`` swaps (``"cpu"`` or ``"cuda"``, the
            current CUDA device); it must be where the forked code's random ops run.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker supports cpu and cuda devices, got {self.device}")
        self.reset()

    def reset(self) -> None:
        """Forget every named state (the default generator is not touched)."""
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}
        self._initialized = False

    def is_initialized(self) -> bool:
        """True once a state was added or ``set_states`` was called."""
        return self._initialized

    # -- state of the device's default generator ------------------------------------------------
    def _get_rng_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    # -- public API ---------------------------------------------------------------------------
    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` seeded with ``seed``; the default generator is not touched.

        Raises:
            ValueError: ``name`` exists already, or another state uses ``seed`` (two names with one
                seed would draw the same masks, which is never intended).
        """
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} of RNG state {name!r} is already used by {self._seeds[seed]!r}")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()
        self._seeds[seed] = name
        self._initialized = True

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (for checkpoints and for replay in recompute)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states by (copies of) ``states``, as returned by ``get_states``."""
        self._states = {name: state.clone() for name, state in states.items()}
        self._initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the state ``name`` in the device's default generator.

        On exit the advanced state is stored back under ``name`` and the default generator
        continues exactly where it was before the block.
        """
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added; known states: {sorted(self._states)}")
        outside = self._get_rng_state()
        self._set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get_rng_state()
            self._set_rng_state(outside)


def model_parallel_seed(
    seed: int,
    tp_rank: int,
    ep_rank: int = 0,
    etp_rank: int | None = None,
    device: torch.device | str | None = None,
    tracker: RNGStatesTracker | None = None,
) -> RNGStatesTracker:
    """A tracker with Megatron's named states for this rank.

    * ``"model-parallel-rng"`` = ``seed + 2718 + tp_rank`` (dropout inside tp regions);
    * ``"expert-parallel-rng"`` = ``seed + 1024 + 100 * ep_rank + etp_rank``;
    * ``"data-parallel-rng"`` = ``seed``.

    ``seed`` is the rank's seed after Megatron's pipeline offset (``seed + 100 * pp_rank``). The
    default generators are the caller's to seed (``torch.manual_seed(seed)``, as
    ``megatron.training`` does); this function does not touch them.

    Args:
        etp_rank: the expert-tensor-parallel rank; default ``tp_rank`` (Megatron's expert tp size
            defaults to the tp size).
        device: where the forked random ops run; default the current CUDA device when CUDA is
            available, else the CPU.
        tracker: fill this (emptied) tracker instead of a new one.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tracker is None:
        tracker = RNGStatesTracker(device)
    tracker.reset()
    etp_rank = tp_rank if etp_rank is None else etp_rank
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + etp_rank)
    tracker.add(DATA_PARALLEL_RNG, seed)
    return tracker


def _replay_contexts(tracker: RNGStatesTracker | None) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recompute sees the tracker states the
    original forward saw, and the tracker is left as the original forward left it."""
    if tracker is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        after_forward = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(after_forward)

    return contextlib.nullcontext(), recompute()


def checkpoint_with_rng(
    function: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None, **kwargs: Any
) -> Any:
    """Activation checkpointing: run ``function(*args, **kwargs)`` without keeping its activations,
    and recompute them in backward.

    Built on ``torch.utils.checkpoint`` (non-reentrant) with ``preserve_rng_state=True``, so the
    default generators replay; ``tracker``'s named states are replayed too, so dropout under
    ``tracker.fork()`` draws the same masks in the recompute as in the original forward.
    """
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: _replay_contexts(tracker),
        **kwargs,
    )
