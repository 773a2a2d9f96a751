"""Megatron's attention mask: emitted by the datasets, accepted by GPTModel, causal masks on the fused path.

Convention: boolean, True = masked. A mask equal to the causal one must run SDPA's ``is_causal``
kernel (and give exactly the unmasked result); any other mask must be applied, which is checked
against an explicit softmax and against running each packed document on its own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.utils import Split
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tokenizer import NullTokenizer
from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.attention import DotProductAttention, causal_mask, mask_for_attention
from megatron.core.transformer.transformer_config import TransformerConfig

S = 12


def tiny(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


def build(cfg: TransformerConfig) -> GPTModel:
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=S, seed=11)


def block_diagonal(starts: list[int], s: int = S) -> torch.Tensor:
    """[1, s, s] True = masked: causal within each document beginning at ``starts``."""
    doc = torch.zeros(s, dtype=torch.int64)
    for st in starts[1:]:
        doc[st:] += 1
    allowed = (doc[:, None] == doc[None, :]) & ~torch.ones(s, s, dtype=torch.bool).triu(1)
    return (~allowed)[None]


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """Every SDPA call's ``is_causal`` and whether a mask was given."""
    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append({"is_causal": kw.get("is_causal", False), "mask": attn_mask is not None})
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(dot_product_attention.F, "scaled_dot_product_attention", spy)
    return calls


# ------------------------------------------------------------------------------------------------ detection
def test_causal_masks_of_every_accepted_shape_become_none():
    c = causal_mask(S, torch.device("cpu"))
    assert (
        c.shape == (1, 1, S, S) and c.dtype == torch.bool and bool(c[0, 0, 0, 1]) and not bool(c[0, 0, 1, 0])
    )
    for mask in (c, c.expand(3, 1, S, S).clone(), c[0].expand(3, S, S).clone()):
        assert mask_for_attention(mask, S) is None
    assert mask_for_attention(None, S) is None


def test_other_masks_are_kept():
    packed = block_diagonal([0, 5])
    assert torch.equal(mask_for_attention(packed, S), packed[None])  # [b, s, s] -> [b, 1, s, s]
    batch = causal_mask(S, torch.device("cpu")).repeat(2, 1, 1, 1)
    batch[1, 0, 7, 2] = True  # one entry of one sample differs: the whole batch is masked attention
    assert mask_for_attention(batch, S) is batch


def test_bad_masks_name_the_problem():
    with pytest.raises(ValueError, match="bool tensor"):
        mask_for_attention(torch.zeros(1, 1, S, S), S)
    with pytest.raises(ValueError, match=r"expected \[b, 1, 12, 12\]"):
        mask_for_attention(torch.zeros(1, 1, S, S + 1, dtype=torch.bool), S)
    with pytest.raises(ValueError, match="has shape"):
        mask_for_attention(torch.zeros(2, 4, S, S, dtype=torch.bool), S)


# ------------------------------------------------------------------------------------------------ attention
def test_dot_product_attention_applies_a_mask_like_an_explicit_softmax():
    """GQA (4 query heads over 2 kv heads), a per-sample mask, against softmax(qk^T/sqrt(d) masked) v."""
    gen = torch.Generator().manual_seed(0)
    b, nq, nkv, d = 2, 4, 2, 8
    q, k, v = (torch.randn(S, b, n, d, generator=gen) for n in (nq, nkv, nkv))
    mask = torch.stack([block_diagonal([0, 4, 9]), block_diagonal([0, 7])])  # [b, 1, s, s]
    core = DotProductAttention(tiny(attention_dropout=0.0))
    out = core(q, k, v, mask)  # [s, b, nq * d]
    kk, vv = (t.repeat_interleave(nq // nkv, dim=2) for t in (k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / math.sqrt(d)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    ref = torch.einsum("bnst,tbnd->sbnd", probs, vv).reshape(S, b, nq * d)
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------------------------------ GPTModel
def test_model_takes_the_fused_causal_path_for_a_causal_mask(sdpa_calls):
    model = build(tiny(position_embedding_type="rope")).eval()
    ids = torch.randint(0, 64, (3, S), generator=torch.Generator().manual_seed(1))
    plain = model(ids, None, None)
    calls_plain = list(sdpa_calls)
    sdpa_calls.clear()
    masked = model(ids, None, causal_mask(S, torch.device("cpu")).expand(3, 1, S, S).clone())
    assert sdpa_calls == calls_plain and all(c["is_causal"] and not c["mask"] for c in sdpa_calls)
    assert len(sdpa_calls) == 2 and torch.equal(masked, plain)


def test_model_applies_a_packed_mask_like_separate_documents(sdpa_calls):
    """Two documents packed into one sequence with a block-diagonal mask and reset positions give,
    position for position, the logits of each document run alone."""
    model = build(tiny()).eval()
    ids = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(2))
    cut = 5
    pos = torch.cat([torch.arange(cut), torch.arange(S - cut)])[None]
    packed = model(ids, pos, block_diagonal([0, cut])[None])
    assert all(c["mask"] and not c["is_causal"] for c in sdpa_calls)
    first = model(ids[:, :cut], None, None)
    second = model(ids[:, cut:], None, None)
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1))


# ------------------------------------------------------------------------------------------------ datasets
def _mock(**flags) -> MockGPTDataset:
    """A mock dataset over 20 documents shorter than a sample (one epoch), so samples hold EODs."""
    cfg = GPTDatasetConfig(
        random_seed=0, sequence_length=S, tokenizer=NullTokenizer(20), log=lambda _: None, **flags
    )
    low = MockGPTLowLevelDataset(cfg.tokenizer)
    short = np.flatnonzero(low.sequence_lengths < S // 2)[:20].astype(np.int32)
    return MockGPTDataset(low, None, short, None, Split.train, cfg)


def test_datasets_emit_one_cached_causal_mask():
    for flags in ({}, dict(reset_position_ids=True, eod_mask_loss=True)):
        train = _mock(**flags)
        a, b = train[0]["attention_mask"], train[1]["attention_mask"]
        assert torch.equal(a, causal_mask(S, torch.device("cpu"))[0]) and a is b  # built once
        batch = torch.utils.data.default_collate([train[0], train[1]])
        assert (
            batch["attention_mask"].shape == (2, 1, S, S)
            and mask_for_attention(batch["attention_mask"], S) is None
        )


def test_create_attention_mask_false_leaves_it_out():
    for flags in ({}, dict(reset_attention_mask=True)):
        assert "attention_mask" not in _mock(create_attention_mask=False, **flags)[0]


def test_reset_attention_mask_is_block_diagonal():
    train = _mock(reset_attention_mask=True, reset_position_ids=True)
    documents = 0
    for i in range(len(train)):
        s = train[i]
        starts = [0] + [t + 1 for t in range(S - 1) if int(s["tokens"][t]) == 19]  # eod = vocab - 1
        assert torch.equal(s["attention_mask"], block_diagonal(starts))
        documents += len(starts)
    assert documents > 2 * len(train)  # the masks were block-diagonal, not merely causal
