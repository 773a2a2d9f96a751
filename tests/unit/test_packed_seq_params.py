"""Megatron-Core's ``PackedSeqParams`` through ``GPTModel.forward(packed_seq_params=...)``: a ``thd``
description runs the same block-diagonal causal attention as the DocumentMask of the same documents
(and as their dense mask); ``sbhd`` / ``bshd`` are no packing; what is not built is refused, naming
the field. ``forward``'s arguments are in Megatron-Core's order. The application's datasets build
no dense mask per sample (the trainer takes packed documents from the tokens)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams, document_mask_of
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.tokenizer import NullTokenizer
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import DataConfig
from megatron.training.datasets.provider import build_train_valid_test_datasets

VOCAB, S = 64, 24
CU = torch.tensor([0, 5, 13, 14, S], dtype=torch.int32)  # four documents, one of a single token

# Megatron-Core 0.19.2's field names, in order.
MCORE_FIELDS = [
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "local_cp_size",
    "cp_group",
]
# Megatron-Core's GPTModel.forward, its positional parameters up to packed_seq_params.
MCORE_FORWARD = [
    "input_ids",
    "position_ids",
    "attention_mask",
    "decoder_input",
    "labels",
    "inference_context",
    "packed_seq_params",
]


@pytest.fixture(scope="module")
def model() -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope",
        params_dtype=torch.float64,
    )
    pg = ParallelState(grid=RankGrid(), rank=0)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, S, seed=5, parallel_state=pg)
    return gpt.double().eval()


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, S), generator=torch.Generator().manual_seed(3))


def _thd(**kw) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU, **kw)


def test_fields_and_forward_order_are_megatron_cores():
    assert [f.name for f in dataclasses.fields(PackedSeqParams)] == MCORE_FIELDS
    names = list(inspect.signature(GPTModel.forward).parameters)[1:]
    assert names[: len(MCORE_FORWARD)] == MCORE_FORWARD
    assert inspect.signature(GPTModel.forward).parameters["loss_mask"].kind is inspect.Parameter.KEYWORD_ONLY


def test_thd_is_the_document_mask_of_its_offsets(model):
    ids = _ids()
    doc_ids = document_mask_of(_thd(max_seqlen_q=8), S, 1).doc_ids
    assert doc_ids.tolist() == [[0] * 5 + [1] * 8 + [2] + [3] * 10]
    packed = model(ids, None, None, packed_seq_params=_thd(max_seqlen_q=8))
    by_mask = model(ids, None, DocumentMask(doc_ids))
    dense = model(ids, None, DocumentMask(doc_ids).dense())
    torch.testing.assert_close(packed, by_mask, rtol=0, atol=0)
    torch.testing.assert_close(packed, dense, rtol=1e-12, atol=1e-12)
    # Each document alone (positions from 0 within it, as --reset-position-ids gives) equals its rows.
    positions = torch.cat([torch.arange(int(b - a)) for a, b in zip(CU[:-1], CU[1:])])[None]
    packed = model(ids, positions, None, packed_seq_params=_thd())
    for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()):
        alone = model(ids[:, a:b], None, None)
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_unpacked_formats_are_causal(model, fmt):
    ids = _ids()
    causal = model(ids, None, None)
    given = model(ids, None, None, packed_seq_params=PackedSeqParams(qkv_format=fmt, cu_seqlens_q=CU))
    torch.testing.assert_close(given, causal, rtol=0, atol=0)


def test_padded_offsets_equal_to_the_unpadded_are_taken(model):
    ids = _ids()
    same = _thd(cu_seqlens_q_padded=CU.clone(), cu_seqlens_kv_padded=CU)
    torch.testing.assert_close(
        model(ids, None, None, packed_seq_params=same), model(ids, None, None, packed_seq_params=_thd())
    )


@pytest.mark.parametrize(
    "params, named",
    [
        (_thd(cu_seqlens_q_padded=torch.tensor([0, 8, 16, 16, S], dtype=torch.int32)), "cu_seqlens_q_padded"),
        (_thd(cu_seqlens_kv_padded=torch.tensor([0, 6, S], dtype=torch.int32)), "cu_seqlens_kv_padded"),
        (PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU[:3]), "cu_seqlens_kv"),
        (PackedSeqParams(qkv_format="thd"), "cu_seqlens_q"),
        (PackedSeqParams(qkv_format="tbhd", cu_seqlens_q=CU), "qkv_format"),
        (_thd(local_cp_size=2), "local_cp_size"),
    ],
)
def test_what_is_not_built_is_refused_naming_the_field(model, params, named):
    with pytest.raises(ValueError, match=named):
        model(_ids(), None, None, packed_seq_params=params)


def test_a_dense_mask_with_packed_params_is_refused(model):
    mask = DocumentMask.from_cu_seqlens(CU, S).dense()
    with pytest.raises(ValueError, match="attention_mask=None"):
        model(_ids(), None, mask, packed_seq_params=_thd())


def test_inference_context_is_refused(model):
    with pytest.raises(ValueError, match="inference_context"):
        model(_ids(), None, None, None, None, object())


def test_default_positions_are_arange_for_any_length(model):
    ids = _ids()[:, :7]  # odd: no 2 x cp chunk split applies without cp
    torch.testing.assert_close(
        model(ids, None, None), model(ids, torch.arange(7)[None], None), rtol=0, atol=0
    )


@pytest.mark.parametrize("in_loader", [True, False])
def test_the_training_datasets_build_no_dense_mask(in_loader):
    """With --reset-attention-mask the trainer takes the documents from the tokens (a DocumentMask),
    so the application's datasets attach no [s, s] mask to a sample, whatever
    --create-attention-mask-in-dataloader says."""
    data = DataConfig(
        mock_data=True,
        reset_attention_mask=True,
        reset_position_ids=True,
        eod_mask_loss=True,
        create_attention_mask_in_dataloader=in_loader,
    )
    train, _, _ = build_train_valid_test_datasets(
        data, NullTokenizer(50), 32, 0, [8, 0, 0], log=lambda _: None
    )
    sample = train[0]
    assert sample.get("attention_mask") is None
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"}
