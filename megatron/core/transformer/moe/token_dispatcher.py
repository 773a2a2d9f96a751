"""Token dispatchers: send each token to the ranks holding its experts, bring the outputs back
weighted by the routing probabilities.

``token_dispatch(hidden [T, h], probs [T, E], routing_map [T, E]) -> (rows [M, h], tokens_per_expert
[E_local])`` gives this rank's experts their rows grouped by local expert (rows past
``sum(tokens_per_expert)`` are padding); ``token_combine(expert_out [M, h]) -> [T, h]`` returns,
for each of this rank's tokens, ``sum_e probs[t, e] * expert_e(hidden[t])`` over its routed experts
(the experts' partial sums over expert-tp included). A token routed to no expert gets 0.

Both are autograd-correct: every collective here has its adjoint as backward (the ``mappings``
functions: all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all).

* :class:`MoEAllGatherTokenDispatcher`: all-gather tokens, probs and map over ``tp_ep`` (etp x ep),
  each rank runs its local experts on the gathered tokens routed to them, the weighted outputs are
  reduce-scattered back (the sum adds the ep ranks' experts and the etp ranks' partial sums). No host
  sync: the rows are a fixed upper bound, the counts stay on the device.
* :class:`MoEAlltoAllTokenDispatcher`: permute by expert, exchange the counts (one host sync for
  the split sizes, as Megatron-Core), all-to-all over ep, all-gather over etp, sort by local
  expert; the reverse path reduce-scatters over etp, all-to-alls back and combines with the probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe.experts import TokensPerExpert
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.moe.permutation import ExactRouting, combine_exact, permute_exact, sort_rows


@dataclass
class TokenPermutation:
    """Where the rows of a permutation come from. ``row_source`` ``[M]``: ``t * E' + e`` for the row
    holding token ``t`` for (map column) expert ``e``, ``T * E'`` for padding rows."""

    row_source: torch.Tensor
    num_tokens: int
    num_columns: int


def permute_tokens(
    tokens: torch.Tensor, routing_map: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, TokenPermutation, torch.Tensor]:
    """Rows grouped by expert (expert-major, tokens ascending within an expert), computed on the
    device without a host sync.

    Args:
        tokens: ``[T, h]``.
        routing_map: ``[T, E']`` bool, True where a token goes to (map column) expert ``e``.
        num_rows: ``M``, at least the number of True entries; rows past them are zero padding.

    Returns:
        ``(rows [M, h], permutation, tokens_per_expert [E'] int64 on the device)``.
    """
    num_tokens, num_columns = routing_map.shape
    mask = routing_map.bool()
    counts = mask.sum(0)  # [E']
    flat, valid = sort_rows(mask, num_rows)  # e * T + t of each row
    source = torch.remainder(flat, num_tokens) * num_columns + torch.div(
        flat, num_tokens, rounding_mode="floor"
    )
    row_source = torch.where(valid, source, num_tokens * num_columns)
    padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])  # row T: zero padding
    rows = padded[torch.div(row_source, num_columns, rounding_mode="floor")]
    return rows, TokenPermutation(row_source, num_tokens, num_columns), counts


def unpermute_tokens(rows: torch.Tensor, perm: TokenPermutation, probs: torch.Tensor) -> torch.Tensor:
    """``[M, h]`` rows of ``perm`` -> ``[T, h]``: each token's rows weighted by ``probs`` ``[T, E']``
    and summed (in fp32, returned in the rows' dtype). Padding rows (whatever they hold) add nothing."""
    total = perm.num_tokens * perm.num_columns
    weights = torch.cat([probs.reshape(-1).float(), probs.new_zeros(1, dtype=torch.float32)])
    valid = (perm.row_source < total).unsqueeze(1)
    weighted = torch.where(valid, rows.float() * weights[perm.row_source].unsqueeze(1), 0.0)
    token = torch.div(perm.row_source, perm.num_columns, rounding_mode="floor")
    out = rows.new_zeros(perm.num_tokens + 1, rows.shape[1], dtype=torch.float32)
    return out.index_add(0, token, weighted)[: perm.num_tokens].to(rows.dtype)


class _Dispatcher:
    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int] | None,
        config: Any,
        groups: MoEGroups | None = None,
    ) -> None:
        self.groups = groups or MoEGroups()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_offset = self.groups.ep_rank * num_local_experts
        expected = list(range(self.local_offset, self.local_offset + num_local_experts))
        assert local_expert_indices is None or list(local_expert_indices) == expected, (
            local_expert_indices,
            expected,
        )
        self.local_expert_indices = expected
        # etp x ep: where the tokens of the experts' ranks come from (the counts for alltoall)
        g = self.groups
        self.tp_ep_group = g.tp_ep
        if self.tp_ep_group is None and g.ep_size * g.etp_size > 1:
            assert g.etp_size == 1 or g.ep_size == 1, "MoEGroups.tp_ep is needed with ep > 1 and etp > 1"
            self.tp_ep_group = g.ep if g.etp_size == 1 else g.etp

    def token_dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, TokensPerExpert]:
        raise NotImplementedError

    def token_combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MoEAllGatherTokenDispatcher(_Dispatcher):
    """All-gather over ``tp_ep``, local experts on the gathered tokens, reduce-scatter back.

    Args:
        num_local_experts: ``num_moe_experts / ep``.
        local_expert_indices: this rank's global expert indices (None: derived from the ep rank).
        config: ``num_moe_experts``, ``moe_router_topk``, ``moe_pad_expert_input_to_capacity``.
        groups: the MoE groups (``tp_ep``, ep rank); None: one rank.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int] | None,
        config: Any,
        groups: MoEGroups | None = None,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, groups)
        self.group = self.tp_ep_group
        # Upper bound of one token's rows: its top-k local experts, or any of them when padding to
        # capacity routes extra tokens. A static row count keeps the permutation off the host.
        pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        self.rows_per_token = num_local_experts if pad else min(config.moe_router_topk, num_local_experts)
        # Dropless with every expert here: each token has exactly top-k rows (ExactRouting's gathers).
        self.exact = self.groups.ep_size == 1 and getattr(config, "moe_expert_capacity_factor", None) is None
        self.compile_helpers = False  # the fused kernels of the exact path (MoELayer sets the plan's choice)

    def token_dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, h]``, ``probs [T, E]``, ``routing_map [T, E]`` -> ``(rows [M, h],
        tokens_per_expert [E_local] on the device)``, ``M = G T * rows_per_token`` (G = tp_ep size)."""
        if mappings.group_size(self.group) > 1:
            hidden = mappings.gather_from_sp(hidden, self.group)  # [G T, h]; backward reduce-scatters
            probs = mappings.gather_from_sp(probs, self.group)
            with torch.no_grad():
                routing_map = mappings.gather_from_sp(routing_map.to(torch.uint8), self.group).bool()
        if self.exact:
            self.routing, tokens_per_expert = ExactRouting.build(
                routing_map, self.rows_per_token, self.compile_helpers
            )
            self.weights = self.routing.row_weights(probs, self.compile_helpers)
            return permute_exact(hidden, self.routing, self.compile_helpers), tokens_per_expert
        local = slice(self.local_offset, self.local_offset + self.num_local_experts)
        self.local_probs = probs[:, local]  # [G T, E_local]
        rows, self.perm, tokens_per_expert = permute_tokens(
            hidden, routing_map[:, local], hidden.shape[0] * self.rows_per_token
        )
        return rows, tokens_per_expert

    def token_combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """``[M, h]`` -> ``[T, h]``: weighted by the probs, summed over tp_ep (reduce-scatter)."""
        if self.exact:
            out = combine_exact(expert_out, self.weights, self.routing, self.compile_helpers)
            del self.routing, self.weights  # this forward's state; autograd keeps what backward needs
        else:
            out = unpermute_tokens(expert_out, self.perm, self.local_probs)  # [G T, h], this rank's experts
            del self.perm, self.local_probs
        return mappings.reduce_scatter_to_sp(out, self.group)


def _all_to_all(
    group: dist.ProcessGroup | None, x: torch.Tensor, output_sizes: list[int], input_sizes: list[int]
) -> torch.Tensor:
    """``mappings.all_to_all`` (backward: the reverse exchange) over a group that must exist."""
    assert group is not None
    return mappings.all_to_all(group, x, output_sizes, input_sizes)


def _sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """``x`` cut into consecutive chunks of ``sizes``, re-concatenated in ``order``."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])


class MoEAlltoAllTokenDispatcher(_Dispatcher):
    """Permute by expert, all-to-all over ep, all-gather over etp, sort by local expert; reverse.

    Args: as :class:`MoEAllGatherTokenDispatcher` (groups: ``ep``, ``etp``, ``tp_ep``).
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int] | None,
        config: Any,
        groups: MoEGroups | None = None,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, groups)
        g = self.groups
        self.ep_size, self.etp_size = g.ep_size, g.etp_size
        if self.ep_size > 1 and self.etp_size > 1:
            # The counts are gathered over tp_ep and read as [ep, etp, E]: etp fastest in its ranks.
            ranks = dist.get_process_group_ranks(g.tp_ep)
            q = self.etp_size
            assert ranks[g.ep_rank * q : (g.ep_rank + 1) * q] == dist.get_process_group_ranks(g.etp), ranks
            assert ranks[g.etp_rank :: q] == dist.get_process_group_ranks(g.ep), ranks
        num_chunks = self.etp_size * self.ep_size * num_local_experts
        p, e = self.ep_size, num_local_experts
        # Received chunks come as (src etp q, src ep r, local expert e); the experts want (e, q, r).
        self.sort_order = [
            qq * p * e + r * e + ee for ee in range(e) for qq in range(self.etp_size) for r in range(p)
        ]
        self.unsort_order = sorted(range(num_chunks), key=self.sort_order.__getitem__)

    def _counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """``[ep, etp, E]`` on the host: tokens each rank of tp_ep sends to each expert. The one host
        sync of the dispatch (the all-to-all's split sizes)."""
        counts = routing_map.sum(0, dtype=torch.long).unsqueeze(0)  # [1, E]
        if mappings.group_size(self.tp_ep_group) > 1:
            counts = mappings.gather_from_sp(counts, self.tp_ep_group)  # [G, E]
        return counts.cpu().view(self.ep_size, self.etp_size, self.num_experts)

    def token_dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """``hidden [T, h]``, ``probs [T, E]``, ``routing_map [T, E]`` -> ``(rows [N, h] sorted by
        local expert, tokens_per_expert [E_local] host ints)``."""
        c = self._counts(routing_map)
        p, q = self.groups.ep_rank, self.groups.etp_rank
        mine = c[:, :, self.local_offset : self.local_offset + self.num_local_experts]  # [ep, etp, E_local]
        rows, self.perm, _ = permute_tokens(hidden, routing_map, int(c[p, q].sum()))
        self.probs = probs
        self.send = c[p, q].view(self.ep_size, self.num_local_experts).sum(1).tolist()  # to each ep rank
        self.recv = mine[:, q].sum(1).tolist()  # from each ep rank
        x = rows
        if self.ep_size > 1:
            x = _all_to_all(self.groups.ep, x, self.recv, self.send)  # [(src ep, expert), h]
        self.num_received = x.shape[0]
        if self.etp_size > 1:
            # all-gather with uneven sizes: send the whole block to every etp rank
            self.gathered = mine.sum(dim=(0, 2)).tolist()  # rows each etp rank received
            x = _all_to_all(
                self.groups.etp, x.repeat(self.etp_size, 1), self.gathered, [x.shape[0]] * self.etp_size
            )
        self.chunk_sizes = mine.permute(1, 0, 2).reshape(-1).tolist()  # (q, r, e) order
        self.sorted_sizes = [self.chunk_sizes[i] for i in self.sort_order]
        return _sort_chunks(x, self.chunk_sizes, self.sort_order), mine.sum(dim=(0, 1)).tolist()

    def token_combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """``[N, h]`` (partial sums over etp) -> ``[T, h]`` weighted by the probs."""
        x = _sort_chunks(expert_out, self.sorted_sizes, self.unsort_order)
        if self.etp_size > 1:
            n, q = self.num_received, self.etp_size
            # reduce-scatter with uneven sizes: block q back to etp rank q, summed there
            x = _all_to_all(self.groups.etp, x, [n] * q, self.gathered)
            x = x.view(q, n, x.shape[-1]).sum(0)
        if self.ep_size > 1:
            x = _all_to_all(self.groups.ep, x, self.send, self.recv)
        out = unpermute_tokens(x, self.perm, self.probs)
        del self.perm, self.probs  # this forward's state; autograd keeps what backward needs
        return out
