"""The rank grid and its named process groups.

Every rank sits at one coordinate of a grid whose axes are, from fastest to slowest varying,
``tp-cp-ep-dp-pp`` (Megatron's default order)::

    global_rank = tp_rank + TP * (cp_rank + CP * (ep_rank + EP * (dp_rank + DP * pp_rank)))

A group for a set of axes (for example ``"tp-dp"``) holds the ranks that differ only along those
axes. ``ParallelState`` bundles the groups this rank belongs to; library classes receive it (or
the one group they need) in their constructor. ``initialize_model_parallel`` builds one and records
it as the default instance, which only public entry points read.

The dense grid uses ``ep = 1``; expert parallelism is folded into its own grid by a later issue.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

AXES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class RankGrid:
    """Pure rank <-> coordinate arithmetic for a ``tp-cp-ep-dp-pp`` grid (no communication)."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis; tp varies fastest."""
        out = {}
        for axis in AXES:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in AXES:
            rank += coords.get(axis, 0) * stride
            stride *= getattr(self, axis)
        return rank

    def groups(self, axes: str) -> list[list[int]]:
        """All groups spanning ``axes`` (e.g. ``"tp-dp"``): ranks that differ only along those axes."""
        varying = axes.split("-")
        for a in varying:
            if a not in AXES:
                raise ValueError(f"unknown parallel axis {a!r}; valid axes are {AXES}")
        fixed = [a for a in AXES if a not in varying]
        result = []
        slow_first = list(reversed(fixed))
        for fixed_vals in itertools.product(*(range(getattr(self, a)) for a in slow_first)):
            base = dict(zip(slow_first, fixed_vals))
            members = []
            for var_vals in itertools.product(*(range(getattr(self, a)) for a in reversed(varying))):
                c = dict(base)
                c.update(dict(zip(reversed(varying), var_vals)))
                members.append(self.rank(c))
            result.append(sorted(members))
        return result


def make_grid(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> RankGrid:
    """Derive the data-parallel degree; raise one error naming every degree when they do not divide."""
    model = tp * pp * cp * ep
    for name, value in (("tensor", tp), ("pipeline", pp), ("context", cp), ("expert", ep)):
        if value < 1:
            raise ValueError(f"--{name}-model-parallel-size must be >= 1, got {value}")
    if world_size % model != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
            f"x expert ({ep}) = {model}; choose degrees whose product divides {world_size}"
        )
    return RankGrid(tp=tp, cp=cp, ep=ep, dp=world_size // model, pp=pp)


# Groups this module creates, as axis strings of the grid.
_GROUP_AXES = {
    "tp": "tp",
    "cp": "cp",
    "ep": "ep",
    "dp": "dp",
    "pp": "pp",
    "dp_cp": "cp-dp",
    "mp": "tp-pp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-cp-dp",
}


@dataclass
class ParallelState:
    """This rank's view of the grid: sizes, ranks along every axis and the process groups.

    ``groups[name]`` is a ``torch.distributed`` group (or ``None`` when torch.distributed is not
    initialised, which is only valid for a world of one). ``embedding_group`` joins the first and
    last pipeline stage of this rank's pipeline (tied input/output embeddings).
    """

    grid: RankGrid
    rank: int
    groups: dict[str, object] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    # Named RNG states (megatron.core.tensor_parallel.random.RNGStatesTracker) for dropout inside
    # tensor-parallel regions; set by whoever seeds the run. None: dropout uses the default RNG.
    rng_tracker: Any = None

    def size(self, axis: str) -> int:
        return getattr(self.grid, axis)

    def axis_rank(self, axis: str) -> int:
        return self.grid.coords(self.rank)[axis]

    # Short accessors in the closed vocabulary of style.md.
    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def cp_rank(self) -> int:
        return self.axis_rank("cp")

    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def dp_cp_group(self):
        return self.groups.get("dp_cp")

    @property
    def mp_group(self):
        return self.groups.get("mp")

    @property
    def embedding_group(self):
        return self.groups.get("embedding")

    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def default_group_timeout() -> timedelta | None:
    """The default group's collective timeout (``init_process_group(timeout=...)``), or None where
    this torch does not expose it; then ``new_group`` uses torch's default (30 minutes for gloo)."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout  # type: ignore[union-attr]
    except Exception:  # a private attribute: absent in some builds and backends
        return None


def build_parallel_state(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                         timeout: timedelta | None = None) -> ParallelState:
    """Create every group of the grid collectively (all ranks must call this in the same order).

    Every group waits ``timeout`` for a collective; None: as long as the default group does.
    (``dist.new_group`` without a timeout would wait torch's default, not the configured one.)
    """
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    if initialized and timeout is None:
        timeout = default_group_timeout()
    grid = make_grid(world_size, tp=tp, pp=pp, cp=cp, ep=ep)
    state = ParallelState(grid=grid, rank=rank)
    named = {name: grid.groups(axes) for name, axes in _GROUP_AXES.items()}
    # Embedding group: first and last stage of every pipeline (one rank when pp == 1).
    named["embedding"] = [sorted({g[0], g[-1]}) for g in named["pp"]]
    for name, all_groups in named.items():
        for ranks in all_groups:
            group = dist.new_group(ranks, timeout=timeout) if initialized else None
            if rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = ranks
    return state


_DEFAULT: ParallelState | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    distributed_timeout_minutes: int | None = None,
) -> ParallelState:
    """Build the groups and record them as the default instance (the Megatron-Core entry point).

    ``distributed_timeout_minutes``: every group's collective timeout; None (unlike Megatron-Core's
    30): the default group's, so that ``init_process_group(timeout=...)`` holds for every group.
    """
    global _DEFAULT
    _DEFAULT = build_parallel_state(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        timeout=None if distributed_timeout_minutes is None else timedelta(minutes=distributed_timeout_minutes),
    )
    return _DEFAULT


def get_parallel_state() -> ParallelState:
    """The default instance; builds a trivial one-rank state when none was initialised."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = build_parallel_state()
    return _DEFAULT


def model_parallel_is_initialized() -> bool:
    return _DEFAULT is not None


def destroy_model_parallel() -> None:
    global _DEFAULT
    _DEFAULT = None


# Megatron-Core style getters, read only by public entry points.
def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def get_data_parallel_world_size() -> int:
    return get_parallel_state().dp_size


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank
