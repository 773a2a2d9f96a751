"""The rank grid: pure rank <-> coordinate arithmetic over five named axes (no communication).

Every rank sits at one coordinate of a grid whose axes are named ``tp, cp, ep, dp, pp``. The grid's
``order`` lists them from fastest to slowest varying; the default ``tp-cp-ep-dp-pp`` (Megatron's)
gives::

    global_rank = tp_rank + TP * (cp_rank + CP * (ep_rank + EP * (dp_rank + DP * pp_rank)))

A group for a set of axes (for example ``"tp-dp"``) holds the ranks that differ only along those
axes. Building a grid validates the sizes and names each degree in the error. The process groups
built from it live in ``parallel_state_grid``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.core.config_utils import ConfigError

AXES = ("tp", "cp", "ep", "dp", "pp")
# The parameter (initialize_model_parallel's, the config field's) that sets each axis's size.
SIZE_PARAMS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
}


class ParallelLayoutError(ConfigError, RuntimeError):
    """A layout that cannot be built. A ConfigError (a user error, naming the parameter) that is
    also the RuntimeError Megatron-Core raises for the same mistakes."""


def parse_order(order: str | Sequence[str]) -> tuple[str, ...]:
    """``"tp-cp-ep-dp-pp"`` -> a tuple of all five axes, fastest first.

    Axes the order leaves out are appended (they must then have size 1; checked by the caller).
    """
    tokens = order.lower().split("-") if isinstance(order, str) else [t.lower() for t in order]
    unknown = [t for t in tokens if t not in AXES]
    if unknown or len(set(tokens)) != len(tokens):
        raise ParallelLayoutError(
            f"order {order!r} is not valid: use each of {'-'.join(AXES)} at most once, separated by '-' "
            f"(e.g. 'tp-cp-ep-dp-pp' or 'tp-cp-ep-pp-dp')",
            params=("order",),
        )
    return tuple(tokens) + tuple(a for a in AXES if a not in tokens)


@dataclass(frozen=True)
class RankGrid:
    """Pure rank <-> coordinate arithmetic for a grid of the five axes (no communication).

    ``order`` lists the axes fastest-varying first (default ``tp-cp-ep-dp-pp``).
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES):
            raise ParallelLayoutError(f"order {self.order} must list each of {AXES} once", params=("order",))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis."""
        out: dict[str, int] = {}
        for axis in self.order:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in AXES}

    def rank(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in self.order:
            rank += coords.get(axis, 0) * stride
            stride *= getattr(self, axis)
        return rank

    def groups(self, axes: str) -> list[list[int]]:
        """All groups spanning ``axes`` (e.g. ``"tp-dp"``): ranks that differ only along those axes.

        Members are ascending; groups are listed with the fastest fixed axis varying fastest (the
        enumeration of Megatron-Core's ``RankGenerator.get_ranks``).
        """
        varying = axes.split("-")
        for a in varying:
            if a not in AXES:
                raise ValueError(f"unknown parallel axis {a!r}; valid axes are {AXES}")
        fixed = [a for a in self.order if a not in varying]
        result: list[list[int]] = []
        slow_first = list(reversed(fixed))
        for fixed_vals in itertools.product(*(range(getattr(self, a)) for a in slow_first)):
            base = dict(zip(slow_first, fixed_vals))
            members = []
            for var_vals in itertools.product(*(range(getattr(self, a)) for a in varying)):
                c = dict(base)
                c.update(dict(zip(varying, var_vals)))
                members.append(self.rank(c))
            result.append(sorted(members))
        return result


def make_grid(
    world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, order: str | Sequence[str] = AXES
) -> RankGrid:
    """Derive the data-parallel degree; raise one error naming every degree when they do not divide."""
    model = tp * pp * cp * ep
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    for axis, value in sizes.items():
        if value < 1:
            raise ParallelLayoutError(
                f"{SIZE_PARAMS[axis]} must be >= 1 (e.g. 1), got {value}", params=(SIZE_PARAMS[axis],)
            )
    if world_size % model != 0:
        product = " x ".join(f"{SIZE_PARAMS[axis]} ({value})" for axis, value in sizes.items())
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by {product} = {model}; choose sizes whose product "
            f"divides {world_size}",
            params=tuple(SIZE_PARAMS[axis] for axis in sizes),
        )
    return RankGrid(tp=tp, cp=cp, ep=ep, dp=world_size // model, pp=pp, order=parse_order(order))


def make_expert_grid(
    world_size: int, etp: int, ep: int, pp: int, order: str | Sequence[str] = AXES
) -> RankGrid:
    """The expert decomposition: expert-tensor (``tp`` axis) x expert (``ep``) x expert-data (``dp``)
    x pipeline, in the dense grid's order (``cp`` is 1)."""
    for name, value in (("expert_tensor_parallel_size", etp), ("expert_model_parallel_size", ep)):
        if value < 1:
            raise ParallelLayoutError(f"{name} must be >= 1 (e.g. 1), got {value}", params=(name,))
    if world_size % (etp * ep * pp) != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp}) = {etp * ep * pp}; "
            f"choose sizes whose product divides {world_size}",
            params=(
                "expert_tensor_parallel_size",
                "expert_model_parallel_size",
                "pipeline_model_parallel_size",
            ),
        )
    return RankGrid(tp=etp, cp=1, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, order=parse_order(order))
