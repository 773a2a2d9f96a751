"""Megatron-Core's ``ProcessGroupCollection``: named process groups handed to model components.

Its fields are Megatron-Core 0.19.2's; ``use_mpu_process_groups()`` fills them from the default
ParallelState (through the ``parallel_state`` getters), and :meth:`from_parallel_state` from any
ParallelState. Fields never set read as None. Groups this package does not build (hierarchical
context parallelism, the inter-instance optimizer group, the all-gather twins) are None.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron.core.parallel_state_grid import ParallelState
from megatron.core.parallel_state_init import initialized_state

# Field -> the ParallelState group name it is (None: not built here).
_STATE_NAMES: dict[str, str | None] = {
    "tp": "tp",
    "pp": "pp",
    "mp": "mp",
    "embd": "embedding",
    "pos_embd": "position_embedding",
    "cp": "cp",
    "tp_cp": "tp_cp",
    "hcp": None,
    "ep": "ep",
    "expt_tp": "expt_tp",
    "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
    "tp_dp_cp": "tp_dp_cp",
    "dp": "dp",
    "dp_cp": "dp_cp",
    "dp_cp_gtp_remat": "dp_cp",
    "dp_cp_ag": None,
    "gtp_remat": None,
    "expt_gtp_remat": None,
    "expt_dp": "expt_dp",
    "expt_dp_gtp_remat": "expt_dp",
    "expt_dp_ag": None,
    "intra_dp_cp": "dp_cp",
    "intra_expt_dp": "expt_dp",
    "inter_dist_opt": None,
    "intra_dist_opt": "intra_dist_opt",
}


def _pg() -> Any:
    return field(init=False)


@dataclass
class ProcessGroupCollection:
    """Process groups by Megatron-Core's names (``tp``, ``pp``, ``cp``, ``dp``, ``dp_cp``, ``ep``,
    ``expt_tp``, ``expt_dp``, ``tp_ep``, ``tp_ep_pp``, ``embd``, ``pos_embd``, ``mp``, ...).

    Construct empty and assign, or pass fields as keywords (an unknown keyword is a ValueError).
    ``gtp_remat`` / ``expt_gtp_remat`` groups are never built here (None).
    """

    tp: Any = _pg()
    pp: Any = _pg()
    mp: Any = _pg()
    embd: Any = _pg()
    pos_embd: Any = _pg()
    cp: Any = _pg()
    tp_cp: Any = _pg()
    hcp: Any = _pg()
    ep: Any = _pg()
    expt_tp: Any = _pg()
    tp_ep: Any = _pg()
    tp_ep_pp: Any = _pg()
    tp_ep_pp_with_egtp_remat: Any = _pg()
    tp_dp_cp: Any = _pg()
    dp: Any = _pg()
    dp_cp: Any = _pg()
    dp_cp_gtp_remat: Any = _pg()
    dp_cp_ag: Any = _pg()
    gtp_remat: Any = _pg()
    expt_gtp_remat: Any = _pg()
    expt_dp: Any = _pg()
    expt_dp_gtp_remat: Any = _pg()
    expt_dp_ag: Any = _pg()
    intra_dp_cp: Any = _pg()
    intra_expt_dp: Any = _pg()
    inter_dist_opt: Any = _pg()
    intra_dist_opt: Any = _pg()

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in fields(self)}
        for key, value in kwargs.items():
            if key not in names:
                raise ValueError(f"ProcessGroupCollection has no field {key!r}; fields are {sorted(names)}")
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        if name in _STATE_NAMES:  # a declared field never set
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute {name!r}")

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            pg = vars(self).get(f.name)
            if pg is None:
                continue
            sizes = [g.size() for g in pg] if isinstance(pg, list) else pg.size()
            parts.append(f"{f.name}({sizes})")
        return f"ProcessGroupCollection({', '.join(parts)})" if parts else "ProcessGroupCollection(empty)"

    @classmethod
    def from_parallel_state(
        cls, state: ParallelState, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The groups of ``state`` under Megatron's names (all fields, or those in ``required_pgs``)."""
        names = list(_STATE_NAMES) if required_pgs is None else list(required_pgs)
        invalid = [n for n in names if n not in _STATE_NAMES]
        if invalid:
            raise ValueError(
                f"Invalid process groups requested: {invalid}; valid names are {sorted(_STATE_NAMES)}"
            )
        return cls(**{n: state.groups.get(_STATE_NAMES[n]) if _STATE_NAMES[n] else None for n in names})

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> ProcessGroupCollection:
        """The default process groups of ``parallel_state`` (those ``initialize_model_parallel`` built)."""
        return cls.from_parallel_state(initialized_state(), required_pgs)
