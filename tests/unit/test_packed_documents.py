"""Packed documents (``--reset-attention-mask`` / ``--reset-position-ids``): one sequence of documents
laid end to end under a ``DocumentMask`` trains as the documents would one by one.

A tiny GPTModel runs one sequence of three documents with the mask and each document's positions
counted from 0; the per-token losses must equal those of running each document as its own sequence
(separate forward calls), and the gradients of the summed loss the sum of the documents' gradients.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.transformer_config import TransformerConfig

EOD, VOCAB = 0, 64
LENGTHS = (5, 7, 4)  # the three documents, each ending in EOD
S = sum(LENGTHS)

MODELS = {
    "rope, gqa, swiglu": dict(
        num_query_groups=2,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        position_embedding_type="rope",
    ),
    "learned positions, mha, gelu": dict(position_embedding_type="learned_absolute"),
}


def _model(name: str) -> GPTModel:
    extra = dict(MODELS[name])
    positions = extra.pop("position_embedding_type")
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        **extra,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=S,
        position_embedding_type=positions,
        seed=5,
    )
    return model.double()


def _packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, S] with an EOD ending each document, labels [1, S], reset positions [1, S])."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (1, S), generator=g)
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    tokens[0, ends] = EOD
    labels = torch.randint(0, VOCAB, (1, S), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return tokens, labels, positions


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_documents_train_as_separate_sequences(name):
    model = _model(name).train()
    tokens, labels, positions = _packed_batch()
    mask = DocumentMask.from_tokens(tokens, EOD)
    assert torch.equal(mask.doc_ids[0], torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS)))

    packed = model(tokens, positions, mask, labels=labels)  # [1, S] per-token losses
    packed.sum().backward()
    packed_grads = _grads(model)

    separate, start = [], 0
    for n in LENGTHS:
        doc = slice(start, start + n)
        losses = model(tokens[:, doc], torch.arange(n)[None], None, labels=labels[:, doc])
        losses.sum().backward()  # gradients accumulate over the documents
        separate.append(losses.detach())
        start += n
    separate_grads = _grads(model)

    torch.testing.assert_close(packed.detach(), torch.cat(separate, dim=1), rtol=1e-12, atol=1e-12)
    assert packed_grads.keys() == separate_grads.keys()
    for key, grad in packed_grads.items():
        torch.testing.assert_close(grad, separate_grads[key], rtol=1e-10, atol=1e-12, msg=key)


def test_document_mask_is_not_plain_causal_attention():
    """The same packed batch without the mask (documents see their predecessors) gives other losses
    after the first document: the test above would notice a mask that is dropped."""
    model = _model("rope, gqa, swiglu").eval()
    tokens, labels, positions = _packed_batch()
    with torch.no_grad():
        masked = model(tokens, positions, DocumentMask.from_tokens(tokens, EOD), labels=labels)
        causal = model(tokens, positions, None, labels=labels)
    first = LENGTHS[0]
    torch.testing.assert_close(masked[:, :first], causal[:, :first], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(masked[:, first:], causal[:, first:])
