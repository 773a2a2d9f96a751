"""Two forked gloo ranks: a from_rank_offsets row split saved, reloaded column split (resharding), with
Megatron-Core's strict handling agreeing across ranks."""

from __future__ import annotations

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling
from tests.distributed.harness import run_distributed

FULL = torch.arange(32, dtype=torch.float32).reshape(8, 4)  # [rows, cols]


def _body(ps, ckpt_dir: str) -> tuple:
    rank = torch.distributed.get_rank()
    rows = ShardedTensor.from_rank_offsets("w", FULL[4 * rank : 4 * rank + 4].clone(), (0, rank, 2))
    rng = ShardedObject("rng", f"state{rank}", (2,), (rank,))
    dist_checkpointing.save({"w": rows, "rng": rng, "step": 3}, ckpt_dir, content_metadata={"v": 1})

    cols = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 2), (1, rank, 2))
    request = {"w": cols}
    if rank == 1:  # only rank 1 asks for an object: it is not missing for rank 0 either
        request["other_rng"] = ShardedObject("rng", None, (2,), (0,))
    out, missing, unexpected = dist_checkpointing.load(request, ckpt_dir, strict=StrictHandling.RETURN_ALL)
    assert out["w"] is cols.data
    torch.testing.assert_close(cols.data, FULL[:, 2 * rank : 2 * rank + 2])
    assert out["step"] == 3 and out["content_metadata"] == {"v": 1}
    if rank == 1:
        assert out["other_rng"] == "state0"
    _, missing_without, _ = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 2), (1, rank, 2))},
        ckpt_dir,
        strict=StrictHandling.RETURN_ALL,
    )

    # an unexpected key on rank 1 only: both ranks raise (nobody waits in a collective)
    bad = {
        "w": cols,
        **({"nope": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))} if rank == 1 else {}),
    }
    with pytest.raises(CheckpointingException, match="unexpected key 'nope'"):
        dist_checkpointing.load(bad, ckpt_dir, strict=StrictHandling.RAISE_UNEXPECTED)
    return missing, unexpected, missing_without


def test_two_ranks_reshard_from_rank_offsets(tmp_path):
    results = run_distributed(
        _body, world_size=2, backend="gloo", kwargs={"ckpt_dir": str(tmp_path / "ckpt")}
    )
    assert [r[:2] for r in results] == [(set(), set()), (set(), set())]
    assert [r[2] for r in results] == [{"rng"}, {"rng"}]  # equal on every rank
    whole = dist_checkpointing.load_plain_tensors(str(tmp_path / "ckpt"))
    torch.testing.assert_close(whole["w"], FULL)
