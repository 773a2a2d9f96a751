"""MockGPTDataset, the Megatron-Core example config, and resumable data loaders."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizer import NullTokenizer
from megatron.training.config import DataConfig
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.datasets.provider import build_train_valid_test_datasets


def mock_datasets(seed=0, seq=64, vocab=100, sizes=(200, 20, 20), **flags):
    cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq, tokenizer=NullTokenizer(vocab), log=lambda _: None, **flags
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, list(sizes), lambda: True, cfg).build()


def test_megatron_core_example():
    cfg = GPTDatasetConfig(
        random_seed=0,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=NullTokenizer(100),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [1000, None, None], lambda: True, cfg
    ).build()
    assert len(train) >= 1000 and len(valid) > 0 and len(test) > 0
    s = train[0]
    assert set(s) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert torch.equal(
        s["attention_mask"], torch.ones(64, 64, dtype=torch.bool).triu(1)[None]
    )  # True = masked
    assert s["tokens"].shape == (64,) and s["tokens"].dtype == torch.int64
    assert s["labels"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])
    assert torch.equal(s["position_ids"], torch.arange(64))
    assert int(s["tokens"].max()) < 100


def test_not_built_on_rank_returns_none():
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=8, tokenizer=NullTokenizer(10))
    assert BlendedMegatronDatasetBuilder(MockGPTDataset, [1, 1, 1], lambda: False, cfg).build() == [None] * 3


def test_mock_is_cheap_with_large_vocab_and_long_sequences():
    train, _, _ = mock_datasets(seq=4096, vocab=128256, sizes=(1000, 10, 10))
    s = train[len(train) - 1]
    assert s["tokens"].shape == (4096,) and int(s["tokens"].max()) < 128256


def test_deterministic_for_a_seed():
    a, _, _ = mock_datasets(seed=3)
    b, _, _ = mock_datasets(seed=3)
    c, _, _ = mock_datasets(seed=4)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(20))
    assert not all(torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(20))


def test_reset_flags_follow_eod():
    (ds, _, _) = mock_datasets(
        seq=512, vocab=50, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    eod = 49
    for i in range(10):
        s = ds[i]
        tokens, pos, mask = s["tokens"], s["position_ids"], s["attention_mask"]
        assert mask.shape == (1, 512, 512) and mask.dtype == torch.bool
        start = 0
        for t in range(512):
            assert int(pos[t]) == t - start
            # query t sees exactly keys [start, t]
            visible = (~mask[0, t]).nonzero().flatten()
            assert visible.tolist() == list(range(start, t + 1))
            assert float(s["loss_mask"][t]) == (0.0 if int(tokens[t]) == eod else 1.0)
            if int(tokens[t]) == eod:
                start = t + 1


def test_loader_resumes_at_consumed_samples():
    train, _, _ = mock_datasets(sizes=(400, 0, 0))
    mbs, dp, steps = 2, 2, 6

    def batches(rank, consumed, workers):
        dl = build_pretraining_data_loader(train, consumed, mbs, rank, dp, workers)
        return [b["tokens"] for b in itertools.islice(dl, steps)]

    straight = [batches(r, 0, 0) for r in range(dp)]
    resumed = [batches(r, 3 * mbs * dp, 2) for r in range(dp)]
    for r in range(dp):
        for a, b in zip(straight[r][3:], resumed[r]):
            assert torch.equal(a, b)
    # the data-parallel ranks see disjoint samples of each global batch
    assert not torch.equal(straight[0][0], straight[1][0])


class _Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i])}


def test_cyclic_loader_resumes_and_wraps():
    n, mbs, dp = 42, 2, 2

    def idx(rank, consumed, k):
        dl = build_pretraining_data_loader(
            _Range(n), consumed, mbs, rank, dp, 0, dataloader_type="cyclic", seed=5
        )
        return list(itertools.islice(iter(dl.batch_sampler), k))

    per_epoch = (n - n % (mbs * dp)) // (mbs * dp)  # micro-batches per rank per epoch
    straight = [idx(r, 0, 3 * per_epoch) for r in range(dp)]
    for r in range(dp):
        assert straight[r][7:] == idx(r, 7 * mbs * dp, 3 * per_epoch - 7)
    for e in range(3):  # each epoch covers every (kept) sample exactly once across the ranks
        seen = [i for r in range(dp) for b in straight[r][e * per_epoch : (e + 1) * per_epoch] for i in b]
        assert sorted(seen) == list(range(n - n % (mbs * dp)))
    assert straight[0][:per_epoch] != straight[0][per_epoch : 2 * per_epoch]


def test_loader_errors():
    train, _, _ = mock_datasets(sizes=(40, 0, 0))
    with pytest.raises(ValueError, match="--dataloader-type"):
        build_pretraining_data_loader(train, 0, 2, 0, 1, 0, dataloader_type="bogus")
    with pytest.raises(ValueError, match="consumed samples"):
        build_pretraining_data_loader(train, len(train), 2, 0, 1, 0)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1, 0) is None


def test_provider_mock_and_errors():
    from megatron.core.tokenizer import NullTokenizer as Null

    logs = []
    tr, va, te = build_train_valid_test_datasets(
        DataConfig(mock_data=True), Null(1000), 32, 1, [64, 8, 8], log=logs.append
    )
    assert len(tr) >= 64 and tr[0]["tokens"].shape == (32,)
    assert any("train" in line for line in logs)
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets(DataConfig(), Null(1000), 32, 1, [1, 1, 1], log=logs.append)
    with pytest.raises(ValueError, match="--data-path.*missing_prefix"):
        build_train_valid_test_datasets(
            DataConfig(data_path=["missing_prefix"]), Null(1000), 32, 1, [1, 1, 1], log=logs.append
        )
