"""Context-parallel attention, every comm type, forward and backward, against one process's full
causal (or document-masked) SDPA over the whole sequence, sliced to each rank's zigzag chunks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import device, run_distributed
from torch.testing import assert_close

from megatron.core.config_utils import ConfigError
from megatron.core.parallel_state import ParallelState
from megatron.core.parallel_state_grid import build_parallel_state
from megatron.core.transformer.context_parallel.attention import ContextParallelAttention
from megatron.core.transformer.context_parallel.layout import ContextParallelGroups, slice_for_cp
from megatron.core.transformer.document_mask import DocumentMask

B, D = 2, 8


def _config(n_q: int, n_kv: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_layers=1,
        num_attention_heads=n_q,
        num_query_groups=n_kv,
        tensor_model_parallel_size=1,
        attention_dropout=0.0,
        softmax_scale=None,
        cp_comm_type=None,
        kv_channels=D,
    )


def _doc_mask(s: int) -> DocumentMask:
    """Documents of lengths crossing chunk boundaries, one longer than a chunk; rows differ."""
    cuts = [[0, 3, 5, 13, s], [0, 1, s - 2, s]]
    ids = torch.zeros(B, s, dtype=torch.int32)
    for b, row in enumerate(cuts):
        for i, (lo, hi) in enumerate(zip(row[:-1], row[1:])):
            ids[b, lo:hi] = i
    return DocumentMask(ids.to(device()))


def _reference(q, k, v, dout, mask):  # [b, n, S, d]
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    attn = None if mask is None else ~mask.dense()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1]
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _case(groups: ContextParallelGroups, comm: str, n_q: int, n_kv: int, s: int, docs: bool) -> None:
    n, r = groups.size, groups.rank
    gen = torch.Generator().manual_seed(n_q * 100 + s)
    q, dout = (torch.randn(B, n_q, s, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, n_kv, s, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v, dout = (t.to(device()) for t in (q, k, v, dout))
    mask = _doc_mask(s) if docs else None
    ref = _reference(q, k, v, dout, mask)

    def local(t: torch.Tensor) -> torch.Tensor:  # [b, n, S, d] -> this rank's [s_l, b, n, d]
        return slice_for_cp(t, 2, n, r).permute(2, 0, 1, 3).contiguous()

    lq, lk, lv = (local(t).requires_grad_(True) for t in (q, k, v))
    attn = ContextParallelAttention(_config(n_q, n_kv), cp_comm_type=comm, cp_groups=groups)
    out = attn(lq, lk, lv, mask)  # [s_l, b, n_q * d]
    out.backward(local(dout).reshape(out.shape))
    what = f"{comm} n_q={n_q} n_kv={n_kv} S={s} docs={docs} rank {r}"
    assert_close(out, local(ref[0]).reshape(out.shape), msg=lambda m: f"out {what}: {m}")
    for name, got, want in zip("qkv", (lq.grad, lk.grad, lv.grad), ref[1:]):
        assert_close(got, local(want), msg=lambda m, name=name: f"d{name} {what}: {m}")


def _all_cases(ps: ParallelState, cases: list[tuple[str, bool]]) -> None:
    groups = ContextParallelGroups(ps.cp_group)
    hierarchical = None
    if any(comm == "a2a+p2p" for comm, _ in cases):
        hps = build_parallel_state(cp=ps.cp_size, hierarchical_cp=[2, ps.cp_size // 2])
        hierarchical = ContextParallelGroups(hps.cp_group, list(hps.hierarchical_cp_groups))
    with pytest.raises(ConfigError, match="num_query_groups"):
        ContextParallelAttention(_config(2 * ps.cp_size, 1), cp_comm_type="a2a", cp_groups=groups)
    with pytest.raises(ConfigError, match="attention_dropout"):
        cfg = _config(2, 2)
        cfg.attention_dropout = 0.1
        ContextParallelAttention(cfg, cp_comm_type="p2p", cp_groups=groups)
    with pytest.raises(ConfigError, match="hierarchical_context_parallel_sizes"):
        ContextParallelAttention(_config(4, 4), cp_comm_type="a2a+p2p", cp_groups=groups)
    for comm, docs in cases:
        g = hierarchical if comm == "a2a+p2p" else groups
        assert g is not None
        n = g.size if comm == "a2a" else 2  # a2a splits query groups over its ranks
        for n_q, n_kv in ((2 * n, n), (n, n)):
            s = 16 * ps.cp_size // 2
            _case(g, comm, n_q, n_kv, s, docs)


CASES = {
    2: [
        ("p2p", False),
        ("p2p", True),
        ("allgather", False),
        ("allgather", True),
        ("a2a", False),
        ("a2a", True),
    ],
    4: [
        ("p2p", False),
        ("p2p", True),
        ("allgather", True),
        ("a2a", True),
        ("a2a+p2p", False),
        ("a2a+p2p", True),
    ],
}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention(cp: int) -> None:
    run_distributed(_all_cases, world_size=cp, cp=cp, kwargs={"cases": CASES[cp]})
