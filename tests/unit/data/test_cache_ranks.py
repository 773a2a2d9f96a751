"""Index caches across ranks: rank 0 builds, the others poll (no collective that could time out)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp
from data_test_utils import random_docs, write_dataset

from megatron.core.datasets.utils import cache_paths, save_cache, wait_for_cache

SUFFIXES = ("description.txt", "a.npy")


def test_wait_for_cache_polls_until_complete(tmp_path):
    paths = cache_paths(str(tmp_path), "h-X-train", SUFFIXES)
    logs = []
    writer = threading.Timer(0.3, save_cache, (paths, "{}", {"a.npy": np.arange(3)}))
    writer.start()
    t0 = time.monotonic()
    wait_for_cache(paths, timeout_s=10, log=logs.append, poll_s=0.05, report_every_s=0.1)
    assert 0.25 < time.monotonic() - t0 < 5 and logs and "waiting for rank 0" in logs[0]


def test_wait_for_cache_reports_builder_failure_and_timeout(tmp_path):
    paths = cache_paths(str(tmp_path), "h-X-train", SUFFIXES)
    with pytest.raises(RuntimeError, match="timed out"):
        wait_for_cache(paths, timeout_s=0.2, poll_s=0.05)
    (tmp_path / "h-X-train-error.txt").write_text("ValueError: boom")
    with pytest.raises(RuntimeError, match="boom"):
        wait_for_cache(paths, timeout_s=5, poll_s=0.05)


def _worker(rank, world, init_file, prefix, cache, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizer import NullTokenizer

    if rank == 0:
        time.sleep(1.0)  # rank 1 must wait for the files, not build them itself
    cfg = GPTDatasetConfig(
        random_seed=7,
        sequence_length=16,
        blend=([prefix], None),
        split="9,1,0",
        path_to_cache=cache,
        tokenizer=NullTokenizer(1000),
        log=lambda _: None,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, None], lambda: True, cfg).build()
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.asarray(train.shuffle_index))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_share_one_cache(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), random_docs(0, 200))
    cache = str(tmp_path / "cache")
    tmp_mp.spawn(_worker, args=(2, str(tmp_path / "init"), prefix, cache, str(tmp_path)), nprocs=2)
    a, b = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    assert np.array_equal(a, b)
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 6  # train + valid, built once
    assert not [f for f in os.listdir(cache) if ".tmp" in f or f.endswith("error.txt")]
    assert torch.equal(torch.from_numpy(a), torch.from_numpy(b))
