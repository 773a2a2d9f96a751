"""Megatron-Core's ``HyperCommGrid``: a named grid of ranks whose groups are made on request.

A thin front over :class:`~megatron.core.parallel_state_grid.RankGrid`: ``dim_names`` is the grid's
order (fastest first, as ``initialize_model_parallel(order=...)``), so ``get_rank_enum(dims)`` is
exactly the enumeration ``RankGenerator.get_ranks`` gives for the same order. The dimension names
are the grid's axes (``tp``, ``cp``, ``ep``, ``dp``, ``pp``), each at most once.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state_grid import AXES, RankGrid, default_group_timeout


class HyperCommGrid:
    """An n-dimensional grid of ``prod(shape)`` ranks starting at ``rank_offset``.

    Args:
        shape: the size of each dimension.
        dim_names: the dimension names, fastest varying first (a subset of ``tp, cp, ep, dp, pp``).
        rank_offset: the first global rank of the grid (default 0).
        backend: the backend of the groups it creates (default: the default group's).

    Raises:
        ValueError: lengths differ, a name is not a grid axis or repeats, a size or the offset is
            negative.
        RuntimeError: the world size is unknown (no ``WORLD_SIZE`` and no process group) or the
            grid does not fit in it.
    """

    def __init__(
        self, shape: list[int], dim_names: list[str], rank_offset: int = 0, backend: str | None = None
    ) -> None:
        if len(shape) != len(dim_names):
            raise ConfigError(
                f"len(shape) {shape} != len(dim_names) {dim_names}", params=("shape", "dim_names")
            )
        bad = [d for d in dim_names if d not in AXES]
        if bad or len(set(dim_names)) != len(dim_names):
            raise ConfigError(
                f"dim_names {dim_names}: use each of {AXES} at most once", params=("dim_names",)
            )
        if any(int(s) < 1 for s in shape):
            raise ConfigError(f"shape {shape} must hold positive sizes", params=("shape",))
        if rank_offset < 0:
            raise ConfigError(f"rank_offset must be non-negative, got {rank_offset}", params=("rank_offset",))
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError(
                "cannot determine the world size: set WORLD_SIZE or initialise torch.distributed "
                "before creating a HyperCommGrid"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.rank_offset = rank_offset
        self.backend = backend
        self.size = 1
        for s in shape:
            self.size *= int(s)
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"grid shape {shape} is over sized with world size {world_size} and rank offset {rank_offset}"
            )
        order = tuple(dim_names) + tuple(a for a in AXES if a not in dim_names)
        self._grid = RankGrid(**dict(zip(dim_names, (int(s) for s in shape))), order=order)
        self._pgs: dict[str, Any] = {}

    def _key(self, dims: str | list[str]) -> tuple[list[str], str]:
        wanted = [dims] if isinstance(dims, str) else list(dims)
        missing = [d for d in wanted if d not in self.dim_names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in dim_names {self.dim_names}")
        ordered = [d for d in reversed(self.dim_names) if d in wanted]  # slowest first, as Megatron keys them
        return ordered, "-".join(ordered)

    def get_rank_enum(self, dims: str | list[str]) -> list[list[int]]:
        """The groups spanning ``dims``: lists of global ranks (ascending), one per group."""
        ordered, _ = self._key(dims)
        return [[r + self.rank_offset for r in g] for g in self._grid.groups("-".join(ordered))]

    def create_pg(self, dims: str | list[str], **kwargs: Any) -> Any:
        """Create the groups spanning ``dims`` (a collective: every rank calls it) and return this
        rank's (None outside the grid). ``kwargs`` go to ``dist.new_group`` (``timeout``,
        ``pg_options``, ``group_desc``); the timeout defaults to the default group's.

        Raises:
            KeyError: the groups for these dims were created already.
        """
        _, key = self._key(dims)
        if key in self._pgs:
            raise KeyError(f"process group {dims} has already been created; get it with get_pg")
        if default_group_timeout() is not None:
            kwargs.setdefault("timeout", default_group_timeout())
        rank = dist.get_rank()
        mine = None
        for ranks in self.get_rank_enum(dims):
            group = dist.new_group(ranks, backend=self.backend, **kwargs)
            if rank in ranks:
                mine = group
        self._pgs[key] = mine
        return mine

    def get_pg(self, dims: str | list[str]) -> Any:
        """This rank's group spanning ``dims``, made earlier by :meth:`create_pg` (else KeyError)."""
        _, key = self._key(dims)
        if key not in self._pgs:
            raise KeyError(f"process group for {key} hasn't been created; call create_pg first")
        return self._pgs[key]

    def is_current_rank_in_grid(self) -> bool:
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    def destroy(self) -> None:
        """Destroy the groups this grid created that this rank belongs to."""
        for pg in {id(g): g for g in self._pgs.values() if g is not None}.values():
            dist.destroy_process_group(pg)
        self._pgs.clear()
