"""Two gloo processes save a row-split tensor, reload it column-split; one process reads it whole."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.training import checkpointing

WORLD = 2
FULL = torch.arange(32, dtype=torch.float32).reshape(8, 4)  # [rows, cols]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, ckpt_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        rows = ShardedTensor.from_rank_offsets("w", FULL[4 * rank : 4 * rank + 4].clone(), (0, rank, WORLD))
        bias = ShardedTensor("b", torch.ones(3) * 7, (3,), (0,), replica_id=rank)  # replicated
        rng = ShardedObject("rng", f"state-{rank}", shard_key=f"r{rank}")
        dist_checkpointing.save({"w": rows, "b": bias, "rng": rng, "step": 3}, ckpt_dir)

        cols = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 2), (1, rank, WORLD))
        bias_in = ShardedTensor("b", torch.zeros(3), (3,), (0,), replica_id=rank)
        out = dist_checkpointing.load(
            {"w": cols, "b": bias_in, "rng": ShardedObject("rng", None, shard_key=f"r{1 - rank}")}, ckpt_dir
        )
        torch.testing.assert_close(cols.data, FULL[:, 2 * rank : 2 * rank + 2])
        torch.testing.assert_close(bias_in.data, torch.ones(3) * 7)
        assert out["rng"] == f"state-{1 - rank}" and out["step"] == 3

        # the training glue in two processes: replicated weights, pure data parallelism, rng per rank
        torch.manual_seed(rank)
        weight = torch.full((2, 2), float(rank))
        model_sd = {"w": ShardedTensor("model.w", weight, (2, 2), (0, 0), replica_id=rank)}
        root = ckpt_dir + "_glue"
        checkpointing.save_checkpoint(root, 7, model_sd, extra_state={"iteration": 7}, log=lambda _: None)
        weight.fill_(-1.0)
        extra = checkpointing.load_checkpoint(root, model_sd, log=lambda _: None)
        assert extra == {"iteration": 7} and (weight == 0.0).all()  # rank 0 wrote the only copy

        # both ranks claim to be the main replica: every rank raises the same error, nobody hangs
        dup = ShardedTensor("b", torch.ones(3), (3,), (0,), replica_id=0)
        with pytest.raises(ValueError, match="overlap"):
            dist_checkpointing.save({"b": dup}, ckpt_dir + "_bad")
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_reshard_and_single_process_load(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    mp.spawn(_worker, args=(_free_port(), ckpt_dir), nprocs=WORLD, join=True)
    whole = ShardedTensor("w", torch.zeros(8, 4), (8, 4), (0, 0))
    out = dist_checkpointing.load(
        {
            "w": whole,
            "r0": ShardedObject("rng", None, shard_key="r0"),
            "r1": ShardedObject("rng", None, shard_key="r1"),
        },
        ckpt_dir,
    )
    torch.testing.assert_close(whole.data, FULL)
    assert (out["r0"], out["r1"]) == ("state-0", "state-1")
    assert sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
