"""The process groups built from the rank grid (no module state: see ``parallel_state``).

The grid itself (axes ``tp, cp, ep, dp, pp``, rank <-> coordinates, size checks) is ``rank_grid``;
this module re-exports it. As in Megatron-Core, the same ranks are decomposed twice: the dense grid
(``ep = 1``; dp is the world over tp x cp x pp) for attention and dense layers, and the expert grid
(``cp = 1``; its ``tp`` axis is the expert-tensor-parallel degree, its ``dp`` the expert-data-parallel
degree) for expert layers. Both use the same order and have the same pipeline groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.rank_grid import AXES as AXES
from megatron.core.rank_grid import SIZE_PARAMS as SIZE_PARAMS
from megatron.core.rank_grid import ParallelLayoutError as ParallelLayoutError
from megatron.core.rank_grid import RankGrid as RankGrid
from megatron.core.rank_grid import make_expert_grid as make_expert_grid
from megatron.core.rank_grid import make_grid as make_grid
from megatron.core.rank_grid import parse_order as parse_order

if TYPE_CHECKING:  # annotation only: importing tensor_parallel imports this module
    from megatron.core.tensor_parallel.rng_states import RNGStatesTracker


def _derived_expert_grid(grid: RankGrid) -> RankGrid:
    """The expert grid of a dense grid built without one: expert tp = tp, expert dp = cp x dp (the
    context and data ranks, adjacent in the default order)."""
    return RankGrid(tp=grid.tp, cp=1, ep=grid.ep, dp=grid.cp * grid.dp, pp=grid.pp, order=grid.order)


# Groups of the dense grid, as axis strings.
_GROUP_AXES = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "pp": "pp",
    "dp_cp": "cp-dp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-cp-dp",
}
# Groups of the expert grid (names as Megatron-Core's ProcessGroupCollection spells them).
_EXPERT_GROUP_AXES = {
    "ep": "ep",
    "expt_tp": "tp",
    "expt_dp": "dp",
    "tp_ep": "tp-ep",
    "tp_ep_pp": "tp-ep-pp",
}
# Gloo twins of the data-parallel groups (the same group when the default backend is gloo).
_GLOO_GROUPS = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp", "expt_dp_gloo": "expt_dp"}


@dataclass
class ParallelState:
    """This rank's view of the grids: sizes, ranks along every axis and the process groups.

    ``groups[name]`` is a ``torch.distributed`` group (or ``None`` when torch.distributed is not
    initialised, which is only valid for a world of one); ``group_ranks[name]`` its global ranks.
    ``embedding`` joins the first and last pipeline stage of this rank's pipeline (tied input/output
    embeddings), ``position_embedding`` the first. ``expert_grid`` is the expert decomposition of
    the same ranks (derived from ``grid`` when not given: expert tp = tp, expert dp = cp x dp).
    """

    grid: RankGrid
    rank: int
    groups: dict[str, ProcessGroup | None] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    # Named RNG states for dropout inside tensor-parallel regions; set by whoever seeds the run.
    # None: dropout uses the default RNG.
    rng_tracker: RNGStatesTracker | None = None
    expert_grid: RankGrid = None  # type: ignore[assignment]  # None: derived in __post_init__

    def __post_init__(self) -> None:
        if self.expert_grid is None:
            self.expert_grid = _derived_expert_grid(self.grid)

    def size(self, axis: str) -> int:
        return int(getattr(self.grid, axis)) if axis != "ep" else self.expert_grid.ep

    def axis_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (``ep``: in the expert grid)."""
        grid = self.expert_grid if axis == "ep" else self.grid
        return grid.coords(self.rank)[axis]

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
    def ep_size(self) -> int:
        return self.expert_grid.ep

    @property
    def ep_rank(self) -> int:
        return self.expert_grid.coords(self.rank)["ep"]

    @property
    def expt_tp_size(self) -> int:
        return self.expert_grid.tp

    @property
    def expt_tp_rank(self) -> int:
        return self.expert_grid.coords(self.rank)["tp"]

    @property
    def expt_dp_size(self) -> int:
        return self.expert_grid.dp

    @property
    def expt_dp_rank(self) -> int:
        return self.expert_grid.coords(self.rank)["dp"]

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self.groups.get("tp")

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self.groups.get("pp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self.groups.get("dp")

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        return self.groups.get("dp_cp")

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in the dp x cp group (cp fastest, as the group's ranks are ordered)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def cp_group(self) -> ProcessGroup | None:
        return self.groups.get("cp")

    @property
    def hierarchical_cp_groups(self) -> list[ProcessGroup | None]:
        """The levels' groups of ``hierarchical_cp`` (level 0 first); empty when not built."""
        return [self.groups[f"hcp{i}"] for i in range(len(self.groups)) if f"hcp{i}" in self.groups]

    @property
    def mp_group(self) -> ProcessGroup | None:
        return self.groups.get("mp")

    @property
    def embedding_group(self) -> ProcessGroup | None:
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


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The ranks of one pipeline holding the word embeddings: its first and last stage."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The ranks of one pipeline holding the position embeddings: its first stage."""
    return [pp_ranks[0]]


def _named_rank_lists(
    grid: RankGrid,
    expert_grid: RankGrid,
    embedding_ranks: Callable[[list[int]], list[int]],
    position_embedding_ranks: Callable[[list[int]], list[int]],
) -> dict[str, list[list[int]]]:
    named = {name: grid.groups(axes) for name, axes in _GROUP_AXES.items()}
    named.update({name: expert_grid.groups(axes) for name, axes in _EXPERT_GROUP_AXES.items()})
    named["embedding"] = [sorted(embedding_ranks(list(g))) for g in named["pp"]]
    named["position_embedding"] = [sorted(position_embedding_ranks(list(g))) for g in named["pp"]]
    named["intra_dist_opt"] = [list(range(grid.world_size))]
    return named


def build_parallel_state(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    timeout: timedelta | None = None,
    *,
    etp: int | None = None,
    order: str | Sequence[str] = AXES,
    embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    gloo_groups: bool = True,
    hierarchical_cp: Sequence[int] | None = None,
) -> ParallelState:
    """Create every group of both grids collectively (all ranks must call this in the same order).

    Args:
        tp, pp, cp: the dense grid's degrees; its dp is the world over ``tp * pp * cp``.
        ep, etp: the expert grid's expert-parallel and expert-tensor-parallel degrees (etp
            defaults to ``tp``); its expert-data degree is the world over ``etp * ep * pp``.
        timeout: every group's collective timeout; None: as long as the default group's.
            (``dist.new_group`` without a timeout would wait torch's default, not the configured one.)
        order: the axes fastest first; when pp is not last the two grids' dp must be equal.
        embedding_ranks / position_embedding_ranks: a pipeline's ranks -> those holding the
            (position) embeddings; default its first and last / its first stage.
        gloo_groups: build gloo twins of the dp, dp-cp and expert-dp groups when the default backend
            is not gloo (under gloo they are the same groups).
        hierarchical_cp: sizes ``[a, b, ...]`` whose product is ``cp`` (``a2a+p2p`` context
            parallelism): level ``i`` groups the cp ranks that differ only in digit ``i`` of their cp
            rank written in these sizes, fastest first (level 0: ``a`` consecutive cp ranks).

    Groups with the same members are created once and shared between names.
    """
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    if initialized and timeout is None:
        timeout = default_group_timeout()
    grid = make_grid(world_size, tp=tp, pp=pp, cp=cp, order=order)
    expert_grid = make_expert_grid(world_size, tp if etp is None else etp, ep, pp, order=grid.order)
    if grid.order[-1] != "pp" and pp > 1 and expert_grid.dp != grid.dp:
        raise ParallelLayoutError(
            f"order {'-'.join(grid.order)!r} does not end with pp: the data-parallel size of dense "
            f"({grid.dp}) and expert ({expert_grid.dp}) layers must then be equal"
        )
    named = _named_rank_lists(
        grid,
        expert_grid,
        embedding_ranks or default_embedding_ranks,
        position_embedding_ranks or default_position_embedding_ranks,
    )
    assert named["pp"] == expert_grid.groups("pp"), "dense and expert pipelines must coincide"
    state = ParallelState(grid=grid, rank=rank, expert_grid=expert_grid)
    created: dict[tuple[tuple[int, ...], str | None], ProcessGroup | None] = {}

    def group_of(ranks: list[int], backend: str | None = None) -> ProcessGroup | None:
        key = (tuple(ranks), backend)
        if key not in created:
            created[key] = dist.new_group(ranks, timeout=timeout, backend=backend) if initialized else None
        return created[key]

    for name, all_groups in named.items():
        for ranks in all_groups:
            group = group_of(ranks)
            if rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = ranks
    if hierarchical_cp:
        for level, ranks_by_group in enumerate(hierarchical_cp_rank_lists(named["cp"], hierarchical_cp)):
            for ranks in ranks_by_group:
                group = group_of(ranks)
                if rank in ranks:
                    state.groups[f"hcp{level}"] = group
                    state.group_ranks[f"hcp{level}"] = ranks
    separate_gloo = initialized and dist.get_backend() != "gloo"
    for gloo_name, name in _GLOO_GROUPS.items() if gloo_groups else ():
        for ranks in named[name]:
            group = group_of(ranks, "gloo") if separate_gloo else created[(tuple(ranks), None)]
            if rank in ranks:
                state.groups[gloo_name] = group
                state.group_ranks[gloo_name] = ranks
    return state


def hierarchical_cp_rank_lists(cp_groups: list[list[int]], sizes: Sequence[int]) -> list[list[list[int]]]:
    """For each level of ``sizes`` (product: the cp size), the rank lists of that level's groups: the
    members of one cp group whose cp ranks differ only in digit ``level`` (mixed radix, fastest first).

    Raises:
        ParallelLayoutError: the sizes' product is not the cp size, or a size is below 1.
    """
    cp = len(cp_groups[0])
    if any(n < 1 for n in sizes) or math.prod(sizes) != cp:
        raise ParallelLayoutError(
            f"hierarchical_context_parallel_sizes {list(sizes)}: the sizes must be >= 1 and multiply to "
            f"context_parallel_size {cp} (e.g. [2, {cp // 2}] when it is even)",
            params=("hierarchical_context_parallel_sizes", "context_parallel_size"),
        )
    levels: list[list[list[int]]] = []
    stride = 1
    for n in sizes:
        groups = []
        for members in cp_groups:
            for start in range(cp):
                if (start // stride) % n == 0:  # the level's first member
                    groups.append([members[start + i * stride] for i in range(n)])
        levels.append(groups)
        stride *= n
    return levels


class RankGenerator:
    """Megatron-Core's rank-group generator, over :class:`RankGrid`.

    ``order`` names the axes fastest first (``"tp-cp-ep-dp-pp"``); axes it leaves out are appended
    and must have size 1. ``get_ranks("tp-dp")`` lists every group spanning those axes, each offset by
    ``rank_offset``. As in Megatron-Core one generator holds either ep or cp (not both), and the
    ``gtp_remat`` axis is accepted with size 1 only (weight rematerialisation is not built here).
    """

    def __init__(
        self,
        tp: int,
        ep: int,
        dp: int,
        pp: int,
        cp: int,
        order: str,
        rank_offset: int = 0,
        gtp_remat: int = 1,
    ) -> None:
        if ep != 1 and cp != 1:
            raise ParallelLayoutError(
                f"RankGenerator takes ep ({ep}) or cp ({cp}) > 1, not both: cp belongs to the dense "
                "generator, ep to the expert one"
            )
        if gtp_remat != 1:
            raise ParallelLayoutError(f"gtp_remat={gtp_remat}: weight rematerialisation is not built; use 1")
        self.tp, self.ep, self.dp, self.pp, self.cp, self.gtp_remat = tp, ep, dp, pp, cp, gtp_remat
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}
        tokens = order.lower().split("-")
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise ParallelLayoutError(
                        f"order {order!r} leaves out {name}, whose size is {size}; add it to the order"
                    )
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]
        self._grid = RankGrid(
            tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=parse_order([t for t in tokens if t != "gtp_remat"])
        )

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Which axes of ``order`` the hyphen-separated ``token`` names."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group spanning the axes of ``token`` (e.g. ``"tp-dp"``), global ranks ascending."""
        axes = "-".join(t for t in token.split("-") if t != "gtp_remat")
        if not axes:  # only the size-1 gtp_remat axis: one rank per group
            return [[r + self.rank_offset] for r in range(self.world_size)]
        return [[r + self.rank_offset for r in g] for g in self._grid.groups(axes)]

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """The weight-rematerialisation groups: one rank each (their size is always 1 here)."""
        if gtp_remat_size != self.gtp_remat:
            raise ParallelLayoutError(f"gtp_remat_size {gtp_remat_size} != this generator's {self.gtp_remat}")
        return self.get_ranks("gtp_remat")


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """Megatron-Core's group enumeration over unnamed axes (fastest first): the groups spanning the
    axes where ``mask`` is True. Up to five axes (they are laid on the grid's axes in order)."""
    if len(parallel_size) != len(mask) or len(parallel_size) > len(AXES):
        raise ParallelLayoutError(
            f"parallel_size {parallel_size} and mask {mask} must have the same length (at most {len(AXES)})"
        )
    sizes: dict[str, Any] = dict(zip(AXES, parallel_size))
    grid = RankGrid(**sizes)
    assert grid.world_size == world_size, f"world_size {world_size} != prod({parallel_size})"
    return grid.groups("-".join(a for a, m in zip(AXES, mask) if m))
