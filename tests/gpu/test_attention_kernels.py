"""CUDA attention kernels, run on the GPU machine:

    python -m pytest tests/gpu/test_attention_kernels.py -q

Variable-length flash attention over packed documents (DotProductAttention with a DocumentMask)
against SDPA with the dense mask, forward and grads, GQA, bf16 tolerance. The CPU suite skips this
file; tests/unit/test_document_mask.py checks the dense path against each document alone.
"""

import pytest
import torch

from megatron.core.transformer.attention import DotProductAttention
from megatron.core.transformer.document_mask import DocumentMask, varlen_supported
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_varlen_document_mask_equals_dense_sdpa(heads, groups):
    torch.manual_seed(0)
    b, s, d = 2, 1024, 128
    tokens = torch.randint(1, 100, (b, s), device="cuda")
    tokens[tokens < 4] = 0  # EOD: documents of ~25 tokens, some rows ending mid-document
    mask = DocumentMask.from_tokens(tokens, 0)
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups
    )
    core = DotProductAttention(config, attention_dropout=0.0)
    q = torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(s, b, heads * d, device="cuda", dtype=torch.bfloat16)
    assert varlen_supported(q.permute(1, 2, 0, 3))
    out = core(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = core(q, k, v, mask.dense())  # the dense bool mask: SDPA
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    assert rel(out, expected) < 1e-2
    for grad, ref in zip(grads, expected_grads):
        assert rel(grad, ref) < 2e-2
