"""The process groups an MoE layer talks over, taken from a ``ParallelState``.

The expert grid decomposes the same ranks as expert-tp x ep x expert-dp x pp (Megatron's grid: ep is
carved from dp x cp, expert-tp defaults to tp). A token's route: the rank that holds it (its tp / cp
slice of the sequence) sends it to the ep rank that holds its expert; the expert's weights are split
over expert-tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.tensor_parallel.mappings import ProcessGroup, group_rank, group_size


@dataclass
class MoEGroups:
    """``ep``: the ranks whose experts together make the layer's experts (ep rank r holds global
    experts ``[r * E / ep, (r + 1) * E / ep)``); ``etp``: the ranks that split one expert's weights;
    ``tp_ep``: etp x ep (the allgather dispatcher's group); ``tp``: the dense tensor-parallel group
    (the layer's input is split over it with sequence parallelism); ``tp_cp``: the ranks that hold
    slices of the same sequences (routing statistics for the auxiliary losses are summed over it);
    ``tp_dp_cp``: every rank of the pipeline stage (``global_aux_loss`` statistics); ``expt_dp``: the
    ranks holding the same expert shard (its gradients are reduced over it). ``None`` = one rank."""

    ep: ProcessGroup | None = None
    etp: ProcessGroup | None = None
    tp_ep: ProcessGroup | None = None
    tp: ProcessGroup | None = None
    tp_cp: ProcessGroup | None = None
    tp_dp_cp: ProcessGroup | None = None
    expt_dp: ProcessGroup | None = None

    @property
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def etp_size(self) -> int:
        return group_size(self.etp)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @classmethod
    def of(cls, pg: Any) -> MoEGroups:
        """The groups of a ParallelState (all None for a world of one or no ParallelState)."""
        if pg is None:
            return cls()
        g = pg.groups
        return cls(
            ep=g.get("ep"),
            etp=g.get("expt_tp"),
            tp_ep=g.get("tp_ep"),
            tp=g.get("tp"),
            tp_cp=g.get("tp_cp"),
            tp_dp_cp=g.get("tp_dp_cp"),
            expt_dp=g.get("expt_dp"),
        )
