"""Where each context-parallel rank's tokens sit in the sequence (the load-balanced "zigzag" split), and
the groups context-parallel attention communicates over.

The sequence of ``S`` tokens is cut into ``2N`` equal chunks for ``N`` cp ranks; cp rank ``r`` holds
chunks ``r`` and ``2N - 1 - r``, in that order, so every rank does the same causal work. Every tensor
that runs along the sequence (tokens, labels, loss mask, position ids, document ids) is sliced this way
before the model; the model's activations are ``[2 * S / (2N), b, h]`` on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from megatron.core import parallel_state
from megatron.core.config_utils import ConfigError
from megatron.core.tensor_parallel.mappings import group_rank, group_size


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that cp rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_seq_length(seq_length: int, cp_size: int, what: str = "sequence length") -> None:
    """Raises ConfigError when ``seq_length`` does not split into ``2 * cp_size`` equal chunks."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ConfigError(
            f"{what} {seq_length} does not split into 2 x context_parallel_size = {2 * cp_size} equal "
            f"chunks; use a multiple of {2 * cp_size}",
            params=("seq_length", "context_parallel_size"),
        )


def local_token_indices(
    seq_length: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[2 * seq_length / (2 cp_size)]`` int64: the global positions of this rank's tokens, in the
    order the rank holds them."""
    check_seq_length(seq_length, cp_size)
    c = seq_length // (2 * cp_size)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def slice_for_cp(x: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's two chunks of ``x`` along ``seq_dim``, concatenated (``x`` unchanged for cp 1)."""
    if cp_size == 1:
        return x
    s = x.shape[seq_dim]
    check_seq_length(s, cp_size)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


# Batch entries that run along the sequence, and the dimension they run along.
SEQUENCE_DIMS = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1, "attention_mask": 2}


def get_batch_on_this_cp_rank(batch: dict, cp_group: ProcessGroup | None = None) -> dict:
    """Megatron-Core's ``get_batch_on_this_cp_rank``: the batch's sequence entries sliced to this cp
    rank's chunks (``attention_mask`` on its query dimension 2); other entries unchanged. ``cp_group``
    defaults to the recorded parallel state's cp group."""
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    n, r = group_size(cp_group), group_rank(cp_group)
    if n == 1:
        return batch
    return {
        k: slice_for_cp(v, SEQUENCE_DIMS[k], n, r) if k in SEQUENCE_DIMS and v is not None else v
        for k, v in batch.items()
    }


COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


@dataclass
class ContextParallelGroups:
    """The groups context-parallel attention talks over: ``group`` (all cp ranks of this rank, in cp
    rank order) and, for ``a2a+p2p``, ``hierarchical`` (level 0: the all-to-all group of consecutive
    cp ranks; level 1: the ring across them)."""

    group: ProcessGroup | None
    hierarchical: list[ProcessGroup | None] = field(default_factory=list)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @classmethod
    def of(cls, pg: Any) -> ContextParallelGroups | None:
        """The groups of a ParallelState, or None when it has no context parallelism."""
        if pg is None or pg.cp_size == 1:
            return None
        return cls(pg.cp_group, list(pg.hierarchical_cp_groups))


def comm_type_of_layer(cp_comm_type: str | list[str] | None, layer_number: int, num_layers: int) -> str:
    """The comm type of global 1-based ``layer_number``: the one value, or the layer's entry of a
    per-layer list (``None``: ``p2p``).

    Raises:
        ConfigError: an unknown type, or a list whose length is not 1 or ``num_layers``.
    """
    types = [cp_comm_type or "p2p"] if not isinstance(cp_comm_type, (list, tuple)) else list(cp_comm_type)
    if len(types) not in (1, num_layers):
        raise ConfigError(
            f"cp_comm_type has {len(types)} entries; give one for every layer or one per layer "
            f"({num_layers})",
            params=("cp_comm_type",),
        )
    for t in types:
        if t not in COMM_TYPES:
            raise ConfigError(
                f"cp_comm_type {t!r} is not one of {', '.join(COMM_TYPES)}", params=("cp_comm_type",)
            )
    return types[0] if len(types) == 1 else types[layer_number - 1]
