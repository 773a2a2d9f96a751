"""Where the trainer's attention mask comes from (issues 22, 28): none for causal attention; with
--reset-attention-mask a DocumentMask built from the tokens (the dense mask is never passed on)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizer import NullTokenizer
from megatron.core.transformer.document_mask import DocumentMask
from megatron.training.config import DataConfig
from megatron.training.datasets.provider import core_gpt_dataset_config
from megatron.training.gpt import (
    CAUSAL,
    DOCUMENTS,
    attention_mask_source,
    document_attention_mask,
    forward_step,
)

VOCAB, EOD, SEQ = 50, 49, 96


def mock_train(**flags):
    cfg = GPTDatasetConfig(
        random_seed=0, sequence_length=SEQ, tokenizer=NullTokenizer(VOCAB), log=lambda _: None, **flags
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, [64, 0, 0], lambda: True, cfg).build()[0]


class Recorder(torch.nn.Module):
    """Stands in for GPTModel: records the mask it is given."""

    pre_process = post_process = True
    pg = None

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.masks: list[torch.Tensor | None] = []

    def forward(self, tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        self.masks.append(attention_mask)
        return torch.zeros(tokens.shape, dtype=torch.float32)


def test_device_mask_is_the_loader_mask():
    ds = mock_train(reset_attention_mask=True, create_attention_mask=True)
    batch = default_collate([ds[i] for i in range(16)])
    assert int((batch["tokens"] == EOD).sum()) > 16  # documents do end inside these samples
    assert torch.equal(document_attention_mask(batch["tokens"], EOD), batch["attention_mask"])


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("in_loader", [True, False])
def test_the_model_gets_a_mask_only_when_it_is_not_causal(reset, in_loader):
    data = DataConfig(
        mock_data=True, reset_attention_mask=reset, create_attention_mask_in_dataloader=in_loader
    )
    source = attention_mask_source(data)
    assert source == (DOCUMENTS if reset else CAUSAL)
    config = core_gpt_dataset_config(data, NullTokenizer(VOCAB), SEQ, 0, log=lambda _: None)
    ds = mock_train(reset_attention_mask=reset, create_attention_mask=config.create_attention_mask)
    model = Recorder()
    forward_step(iter([default_collate([ds[i] for i in range(4)])]), model, attention_mask=source, eod=EOD)
    (given,) = model.masks
    if source == CAUSAL:
        assert given is None  # fused causal attention: nothing built, broadcast or compared
    else:  # whatever --create-attention-mask-in-dataloader says: the documents, not a dense mask
        reference = mock_train(reset_attention_mask=True, create_attention_mask=True)
        expected = default_collate([reference[i] for i in range(4)])["attention_mask"]
        assert isinstance(given, DocumentMask) and torch.equal(given.dense(), expected)


def test_the_flag_is_generated_with_megatrons_spelling():
    from megatron.training.arguments import parse_run_config

    base = (
        "--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3 --mock-data --vocab-size 64 --tokenizer-type NullTokenizer"
    ).split()
    assert parse_run_config(base).data.create_attention_mask_in_dataloader is True  # Megatron's default
    assert (
        parse_run_config(
            base + ["--no-create-attention-mask-in-dataloader"]
        ).data.create_attention_mask_in_dataloader
        is False
    )


def test_a_causal_mask_from_the_loader_is_not_passed_on():
    """A dataset that attaches Megatron's plain causal mask to every sample (GPTDatasetConfig's
    create_attention_mask for library users) still gives the trainer's model no mask without
    --reset-attention-mask."""
    ds = mock_train()
    batch = default_collate([ds[i] for i in range(2)])
    batch["attention_mask"] = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)
    model = Recorder()
    forward_step(iter([batch]), model, attention_mask=CAUSAL)
    assert model.masks == [None]
