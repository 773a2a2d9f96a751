"""Token permutation for the experts, on the device and without a host sync.

* :func:`sort_rows`: the rows of a routing map ``[T, E']`` grouped by expert (expert-major, tokens
  ascending within an expert), found by one stable sort of the map's ``E' T`` entries (a cumulative
  sum down the token dim, the other way to number them, is a slow outer-dim scan on CUDA).
* :class:`ExactRouting`: the dropless case where every token has exactly ``k`` rows (top-k routing,
  every expert on this rank, no capacity). Then the permutation and the weighted combine are pure
  gathers in both directions: no padding rows, no scatter-add, no atomics, the same results in any
  order of the GPU's threads. :func:`permute_exact` and :func:`combine_exact` are their autograd
  functions; their math runs as compiled kernels where the caller asks (``compile``: the execution
  plan's ``compile_helpers``, CUDA only).

The combine sums each token's ``k`` weighted rows in fp32 in expert order and rounds once, as the
general path (``token_dispatcher.unpermute_tokens``) does, so both give the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.fusions.compile import maybe_compiled


def sort_rows(routing_map: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat [num_rows], valid [num_rows])``: for each row, the map entry ``e * T + t`` it holds
    (expert ``e``, token ``t``), expert-major with tokens ascending; rows past the map's True entries
    are padding (``valid`` False, ``flat`` some False entry or ``E' T`` when the map has fewer
    entries than rows)."""
    num_tokens, num_columns = routing_map.shape
    entries = routing_map.t().reshape(-1)  # [E' T], expert-major
    order = torch.argsort(entries.logical_not().to(torch.uint8), stable=True)  # True entries first
    if num_rows > order.numel():
        pad = order.new_full((num_rows - order.numel(),), num_tokens * num_columns)
        order = torch.cat([order, pad])
    flat = order[:num_rows]
    valid = torch.cat([entries, entries.new_zeros(1)])[flat]
    return flat, valid


@dataclass
class ExactRouting:
    """Every token on exactly ``topk`` rows of the ``T * topk`` rows (dropless top-k, all experts
    local). ``token_of_row [M]``: the token each row holds; ``rows_of_token [T, k]``: each token's
    rows in expert order; ``flat [M]``: the map entry ``e * T + t`` of each row."""

    token_of_row: torch.Tensor
    rows_of_token: torch.Tensor
    flat: torch.Tensor
    num_tokens: int
    topk: int

    @classmethod
    def build(
        cls, routing_map: torch.Tensor, topk: int, compile: bool = False
    ) -> tuple[ExactRouting, torch.Tensor]:
        """From a map with exactly ``topk`` True entries per token; ``(routing, tokens_per_expert
        [E'] int64 on the device)``."""
        token_of_row, rows_of_token, flat, counts = _exact_indices(routing_map, topk, compile=compile)
        return cls(token_of_row, rows_of_token, flat, routing_map.shape[0], topk), counts

    def row_weights(self, probs: torch.Tensor, compile: bool = False) -> torch.Tensor:
        """``[M]`` fp32: each row's routing probability from ``probs [T, E']`` (differentiable)."""
        return _row_weights(probs, self.flat, compile=compile)


@maybe_compiled
def _exact_indices(
    routing_map: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens = routing_map.shape[0]
    flat, _ = sort_rows(routing_map, num_tokens * topk)
    token_of_row = flat % num_tokens
    rows_of_token = torch.argsort(token_of_row, stable=True).view(num_tokens, topk)
    return token_of_row, rows_of_token, flat, routing_map.sum(0)


@maybe_compiled
def _row_weights(probs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    return probs.float().t().reshape(-1).gather(0, flat)


@maybe_compiled
def _sum_token_rows(grad_rows: torch.Tensor, rows_of_token: torch.Tensor) -> torch.Tensor:
    """``[M, h]`` -> ``[T, h]``: each token's rows summed in fp32, rounded once."""
    t, k = rows_of_token.shape
    picked = grad_rows.index_select(0, rows_of_token.reshape(-1)).view(t, k, -1)
    return picked.float().sum(1).to(grad_rows.dtype)


@maybe_compiled
def _combine_forward(rows: torch.Tensor, weights: torch.Tensor, rows_of_token: torch.Tensor) -> torch.Tensor:
    t, k = rows_of_token.shape
    index = rows_of_token.reshape(-1)
    picked = rows.index_select(0, index).view(t, k, -1).float()
    return (picked * weights.index_select(0, index).view(t, k, 1)).sum(1).to(rows.dtype)


@maybe_compiled
def _combine_backward(
    grad: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, token_of_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad.index_select(0, token_of_row).float()  # [M, h]
    return (g * weights.unsqueeze(1)).to(rows.dtype), (g * rows.float()).sum(1)


class _PermuteExact(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, routing: ExactRouting, compile: bool) -> torch.Tensor:
        ctx.routing, ctx.compile = routing, compile
        return tokens.index_select(0, routing.token_of_row)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _sum_token_rows(grad.contiguous(), ctx.routing.rows_of_token, compile=ctx.compile), None, None


class _CombineExact(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, weights: torch.Tensor, routing: ExactRouting, compile: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, weights)
        ctx.routing, ctx.compile = routing, compile
        return _combine_forward(rows, weights, routing.rows_of_token, compile=compile)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        rows, weights = ctx.saved_tensors
        d_rows, d_weights = _combine_backward(
            grad.contiguous(), rows, weights, ctx.routing.token_of_row, compile=ctx.compile
        )
        return d_rows, d_weights, None, None


def permute_exact(tokens: torch.Tensor, routing: ExactRouting, compile: bool = False) -> torch.Tensor:
    """``[T, h]`` -> ``[T k, h]`` rows grouped by expert; backward sums each token's rows."""
    out: torch.Tensor = _PermuteExact.apply(tokens, routing, compile)
    return out


def combine_exact(
    rows: torch.Tensor, weights: torch.Tensor, routing: ExactRouting, compile: bool = False
) -> torch.Tensor:
    """``[T k, h]`` expert outputs and their ``[T k]`` fp32 weights -> ``[T, h]``: each token's rows
    weighted and summed (fp32, in expert order, rounded once to the rows' dtype)."""
    out: torch.Tensor = _CombineExact.apply(rows, weights, routing, compile)
    return out
