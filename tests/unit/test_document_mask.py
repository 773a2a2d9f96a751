"""DocumentMask (packed documents): the dense mask equals GPTDataset's --reset-attention-mask mask,
DotProductAttention with it equals running each document alone (forward and grads, GQA), and what the
kernels derive from it is computed once per micro-batch."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.attention import DotProductAttention, mask_for_attention
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.gpt import document_attention_mask

EOD = 0


def packed_tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    """``[b, s]`` tokens in 1..9 with a few EOD tokens, one of them last in a row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 10, (b, s), generator=g)
    tokens[0, [2, 3, 9]] = EOD
    tokens[-1, [5, s - 1]] = EOD
    return tokens


def config(heads: int, groups: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=8 * heads,
        num_attention_heads=heads,
        num_query_groups=groups,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def test_dense_equals_the_dataset_mask():
    tokens = packed_tokens(3, 16)
    mask = DocumentMask.from_tokens(tokens, EOD)
    torch.testing.assert_close(mask.dense(), document_attention_mask(tokens, EOD))
    assert mask_for_attention(mask, 16) is mask


def test_from_cu_seqlens_matches_from_tokens():
    tokens = packed_tokens(2, 16)
    mask = DocumentMask.from_tokens(tokens, EOD)
    cu_seqlens, max_seqlen = mask.varlen()
    assert cu_seqlens.tolist() == [0, 3, 4, 10, 16, 22, 32]
    assert max_seqlen == 10
    again = DocumentMask.from_cu_seqlens(cu_seqlens, 16, batch_size=2, max_seqlen=max_seqlen)
    torch.testing.assert_close(again.dense(), mask.dense())
    assert again.varlen()[1] == max_seqlen


def test_derived_forms_are_computed_once():
    mask = DocumentMask.from_tokens(packed_tokens(2, 16), EOD)
    assert mask.dense() is mask.dense()
    assert mask.varlen() is mask.varlen()


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_attention_equals_each_document_alone(heads, groups):
    b, s, d = 2, 16, 8
    tokens = packed_tokens(b, s)
    mask = DocumentMask.from_tokens(tokens, EOD)
    core = DotProductAttention(config(heads, groups))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    dout = torch.randn(s, b, heads * d, generator=g)
    out = core(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    cu_seqlens = mask.varlen()[0].tolist()
    flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v, dout)]  # [b*s, ...]
    expected_out = torch.empty(b * s, heads * d)
    expected_grads = [torch.empty(b * s, *t.shape[2:]) for t in (q, k, v)]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        doc = [t[start:end].detach().unsqueeze(1).requires_grad_() for t in flat[:3]]  # [len, 1, n, d]
        alone = core(*doc, None)
        expected_out[start:end] = alone[:, 0].detach()
        for dst, grad in zip(expected_grads, torch.autograd.grad(alone, doc, flat[3][start:end, None])):
            dst[start:end] = grad[:, 0]
    torch.testing.assert_close(out.transpose(0, 1).reshape(b * s, -1), expected_out)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.transpose(0, 1).reshape(b * s, *grad.shape[2:]), expected)
