"""FLOPs formula against hand-computed values, and the peak table."""

import pytest
import torch

from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import (
    FlopsShape,
    document_lengths,
    document_masked_floating_point_operations,
    num_floating_point_operations,
    peak_tflops,
    shape_from_config,
)


def test_dense_gpt_matches_closed_form():
    # Classic GPT (F = 4h, MHA, GELU): 72 B s L h^2 (1 + s/(12h) + V/(12 L h)), written as integers.
    B, s, L, h, V = 8, 32, 2, 64, 128
    cfg = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=4)
    expected = 72 * B * s * L * h * h + 6 * B * s * s * L * h + 6 * B * s * h * V
    assert num_floating_point_operations(shape_from_config(cfg, V), B, s) == expected


def test_gqa_swiglu_by_hand():
    # L=1, h=8, 4 heads of d=2 in 2 groups, SwiGLU F=16, V=32, one sample of 4 tokens.
    shape = FlopsShape(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=2,
        ffn_hidden_size=16,
        padded_vocab_size=32,
        swiglu=True,
    )
    mlp = 6 * 8 * 3 * 16  # 2304
    proj = 6 * (8 * (8 + 2 * 2 * 2) + 8 * 8)  # 1152
    logits = 6 * 8 * 32  # 1536
    core = 1 * 4 * 4 * 6 * 8  # B s^2 6 q_p L = 768
    assert num_floating_point_operations(shape, 1, 4) == 4 * (mlp + proj + logits) + core == 20736


def test_llama3_8b_per_step_flops():
    # Llama-3-8B shape, one 4096-token sample: hand-expanded terms.
    shape = FlopsShape(32, 4096, 32, 8, 128, 14336, 128256, True)
    per_token = (
        6 * 4096 * 3 * 14336 * 32 + 6 * (4096 * (4096 + 2 * 128 * 8) + 4096 * 4096) * 32 + 6 * 4096 * 128256
    )
    expected = 4096 * per_token + 4096 * 4096 * 6 * 4096 * 32
    assert num_floating_point_operations(shape, 1, 4096) == expected
    assert 1.9e14 < expected < 2.1e14  # about 6 x 8e9 params x 4096 tokens, plus attention


def test_peak_table():
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops(None) is None
    assert peak_tflops("Some Future Accelerator") is None


SMALL = FlopsShape(1, 8, 4, 2, 2, 16, 32, True)  # the GQA / SwiGLU shape above


def test_document_masked_attention_counts_each_documents_square():
    # One sample of 4 tokens as documents of 1 and 3: attention 6 q_p L (1 + 9) instead of 6 q_p L 16.
    full = num_floating_point_operations(SMALL, 1, 4)
    docs = document_masked_floating_point_operations(SMALL, 1, 4, [1, 3])
    assert full - docs == 6 * 8 * 1 * (16 - 10)
    # One document per sample is the full-causal convention; two samples, lengths over both.
    assert document_masked_floating_point_operations(SMALL, 2, 4, [4, 4]) == num_floating_point_operations(
        SMALL, 2, 4
    )
    with pytest.raises(ValueError, match="add up to 5 tokens"):
        document_masked_floating_point_operations(SMALL, 1, 4, [2, 3])


def test_document_lengths_of_a_document_mask():
    eod = 0
    tokens = torch.tensor([[5, 0, 7, 7, 0, 3], [1, 2, 3, 4, 5, 0]])
    assert document_lengths(DocumentMask.from_tokens(tokens, eod).doc_ids) == [2, 3, 1, 6]
