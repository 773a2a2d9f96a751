"""The process's runtime state: one object, built at start-up, the only module-level mutable state
of the library and the application.

``Runtime`` holds what Megatron keeps in module globals:

- ``layout`` (:class:`LayoutState`): what belongs to one parallel layout: the default ParallelState
  ``initialize_model_parallel`` records, the values Megatron's setters override, the RNG tracker
  handed out before seeding, the pipeline groups whose communicators are warmed up, the global
  memory buffer. ``destroy_model_parallel`` replaces it with an empty one, so nothing of one layout
  leaks into the next.
- the process's settings and probes: the default micro-batch calculator, the Transformer Engine
  version, whether NVTX ranges are on;
- ``app``: the training application's state (``megatron.training.global_vars.AppState``: its
  arguments, its error channel), opaque to the library, which never imports the application.

Library classes receive their groups, tracker and calculator; they do not read this state. The
Megatron-named public entry points (``parallel_state.get_*``, ``get_cuda_rng_tracker``,
``get_num_microbatches``, ``get_args``, ...) read it through :func:`get_runtime`, and so does the
pipeline's ``P2PCommunicator`` for one process-wide record, the groups it has warmed up.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron.core.parallel_state_grid import ParallelState

if TYPE_CHECKING:  # annotations only: these modules import this one
    from packaging.version import Version

    from megatron.core.num_microbatches_calculator import NumMicroBatchesCalculator
    from megatron.core.tensor_parallel.rng_api import CudaRNGStatesTracker


class GlobalMemoryBuffer:
    """Reusable flat buffers by ``(name, dtype)`` (callers must not use one name concurrently).

    Megatron-Core's ``megatron.core.utils.GlobalMemoryBuffer``; the process's instance is the layout
    state's ``memory_buffer`` (``parallel_state.get_global_memory_buffer()``).
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> torch.Tensor:
        """A view of shape ``tensor_shape`` into the buffer (grown when too small), on the current
        CUDA device or else the CPU."""
        needed = functools.reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < needed:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            with (mem_alloc_context or nullcontext)():
                self.buffer[key] = torch.empty(needed, dtype=dtype, device=device, requires_grad=False)
        return self.buffer[key][0:needed].view(*tensor_shape)


class WarmedGroups:
    """The process groups whose first collective has run (NCCL wants it to involve every rank).

    A group is held (not only its ``id``) until :meth:`clear`, so a destroyed group's id cannot be
    taken for a new group's while it is recorded.
    """

    def __init__(self) -> None:
        self._groups: dict[int, object] = {}

    def __contains__(self, group: object) -> bool:
        return self._groups.get(id(group)) is group

    def add(self, group: object) -> None:
        self._groups[id(group)] = group

    def __len__(self) -> int:
        return len(self._groups)

    def clear(self) -> None:
        self._groups.clear()


@dataclass
class LayoutState:
    """The state of one parallel layout; ``destroy_model_parallel`` starts a new one.

    Attributes:
        parallel_state: the default ParallelState (``initialize_model_parallel``'s, or a one-rank
            state built on first use; None: not built yet).
        initialized: ``initialize_model_parallel`` ran (a lazily built one-rank state does not count).
        overrides: values set through Megatron's setters (``"tp_size"``, ``"tp_rank"``, ``"pp_size"``,
            ...) and the virtual pipeline's ``"vpp_rank"`` / ``"vpp_size"``.
        unbound_rng_tracker: the tracker ``get_cuda_rng_tracker`` hands out before any ParallelState
            holds one; the next ``model_parallel_cuda_manual_seed`` fills and binds it.
        warmed_p2p_groups: pipeline groups whose communicator ran its warm-up collective.
        memory_buffer: ``get_global_memory_buffer``'s buffer (made on first use).
    """

    parallel_state: ParallelState | None = None
    initialized: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    unbound_rng_tracker: CudaRNGStatesTracker | None = None
    warmed_p2p_groups: WarmedGroups = field(default_factory=WarmedGroups)
    memory_buffer: GlobalMemoryBuffer | None = None


@dataclass
class Runtime:
    """Everything process-wide (see the module docstring).

    Attributes:
        layout: the current parallel layout's state.
        num_microbatches_calculator: the default calculator of ``get_num_microbatches`` (the trainer
            records the one it holds); None: not initialised.
        te_version: Transformer Engine's version, probed once (None: not probed yet).
        nvtx_enabled: ``nvtx_range_push`` / ``nvtx_range_pop`` open and close ranges.
        app: the training application's state, opaque here (None: no application started).
    """

    layout: LayoutState = field(default_factory=LayoutState)
    num_microbatches_calculator: NumMicroBatchesCalculator | None = None
    te_version: Version | None = None
    nvtx_enabled: bool = False
    app: object | None = None

    def reset_layout(self) -> LayoutState:
        """Start an empty layout state; returns the previous one."""
        previous, self.layout = self.layout, LayoutState()
        return previous


_RUNTIME = Runtime()


def get_runtime() -> Runtime:
    """The process's runtime state."""
    return _RUNTIME


def set_runtime(runtime: Runtime) -> Runtime:
    """Make ``runtime`` the process's runtime state; returns the previous one (for tests that run
    a body under a state of their own and put the old one back)."""
    global _RUNTIME
    previous, _RUNTIME = _RUNTIME, runtime
    return previous


def reset_runtime() -> Runtime:
    """Forget every piece of process state (a fresh :class:`Runtime`); returns the previous one."""
    return set_runtime(Runtime())
