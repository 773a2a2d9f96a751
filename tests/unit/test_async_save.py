"""--async-save's writer (dist_checkpointing.async_save) and the retention rules of --ckpt-keep-last and
--save-retain-interval (checkpoint_dirs), without training: the end-to-end runs are in
tests/functional/test_async_save.py."""

from __future__ import annotations

import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, torch_dist
from megatron.core.dist_checkpointing.async_save import AsyncWriter
from megatron.training import checkpoint_dirs
from tests.distributed.harness import run_distributed

FULL = torch.arange(24.0).reshape(4, 6)


def _state(rank: int, world: int, w: torch.Tensor) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.ones(3, dtype=torch.bfloat16), replica_id=rank),
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
        "plain": [1, 2],
    }


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _two_rank_body(ps, root: str) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    w = FULL.chunk(world)[rank].clone()
    dist_checkpointing.save(_state(rank, world, w), f"{root}/sync", common_state={"it": 1})
    writer = AsyncWriter()
    pending = writer.start(_state(rank, world, w), f"{root}/async", common_state={"it": 1})
    w.add_(100.0)  # the staged copy is written, not what the tensor holds now
    pending.result()
    torch.distributed.barrier()
    assert dist_checkpointing.is_complete_checkpoint(f"{root}/async")
    writer.close()


def test_two_ranks_write_in_the_background_what_a_synchronous_save_writes(tmp_path):
    run_distributed(_two_rank_body, world_size=2, backend="gloo", kwargs={"root": str(tmp_path)})
    sync, written = _files(str(tmp_path / "sync")), _files(str(tmp_path / "async"))
    assert sorted(written) == sorted(sync) == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    # byte for byte: the blocks, objects and common values; DCP's index apart from its random save id
    assert {k: v for k, v in written.items() if k != ".metadata"} == {
        k: v for k, v in sync.items() if k != ".metadata"
    }
    index = [torch_dist.read_dcp_metadata(str(tmp_path / d)) for d in ("sync", "async")]
    assert index[0].state_dict_metadata == index[1].state_dict_metadata
    assert index[0].storage_data == index[1].storage_data
    torch.testing.assert_close(dist_checkpointing.load_plain_tensors(str(tmp_path / "async"))["w"], FULL)


def test_staged_buffers_are_allocated_once_and_a_second_write_waits_for_the_first(tmp_path, monkeypatch):
    seen: list[list[int]] = []
    original = torch_dist._BlockSavePlanner.set_up_planner

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        seen.append([t.data_ptr() for t in state_dict["tensors"]])
        # each staged block's storage is exactly its bytes: DCP writes it without copying it again
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in state_dict["tensors"])
        return original(self, state_dict, storage_meta, is_coordinator)

    monkeypatch.setattr(torch_dist._BlockSavePlanner, "set_up_planner", set_up_planner)
    w = FULL.clone()
    writer = AsyncWriter()
    first = writer.start(_state(0, 1, w), str(tmp_path / "a"))
    with pytest.raises(RuntimeError, match="still pending: call result"):
        writer.start(_state(0, 1, w), str(tmp_path / "b"))
    first.result()
    assert not dist_checkpointing.is_complete_checkpoint(str(tmp_path / "b"))
    w.mul_(2.0)
    writer.start(_state(0, 1, w), str(tmp_path / "b")).result()
    writer.close()
    assert len(seen) == 2 and seen[0] == seen[1] and w.data_ptr() not in seen[0], seen
    torch.testing.assert_close(dist_checkpointing.load_plain_tensors(str(tmp_path / "a"))["w"], FULL)
    torch.testing.assert_close(dist_checkpointing.load_plain_tensors(str(tmp_path / "b"))["w"], 2 * FULL)


def test_a_failed_background_write_is_reported_by_result_and_never_marked_complete(tmp_path, monkeypatch):
    def no_space(self, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch_dist._RecordingFileIO, "write", no_space)
    writer = AsyncWriter()
    pending = writer.start(_state(0, 1, FULL.clone()), str(tmp_path / "a"))
    with pytest.raises(dist_checkpointing.CheckpointWriteError, match="No space left on device"):
        pending.result()
    writer.close()
    assert not dist_checkpointing.is_complete_checkpoint(str(tmp_path / "a"))


# ------------------------------------------------------------------------------------------------
# Retention


def _make(root, *names: str, complete: bool = True) -> None:
    for name in names:
        os.makedirs(root / name)
        if complete:
            (root / name / "metadata.json").write_text("{}")


@pytest.mark.parametrize(
    ("keep_last", "retain", "previous", "expected"),
    [
        (2, None, 8, {2: "--ckpt-keep-last 2", 4: "--ckpt-keep-last 2", 6: "--ckpt-keep-last 2"}),
        (1, None, 8, {it: "--ckpt-keep-last 1" for it in (2, 4, 6, 8)}),
        (10, None, 8, {}),
        (None, 4, 8, {}),  # the previous one is a multiple of 4: kept
        (None, 3, 8, {8: "--save-retain-interval 3: 8 is not a multiple of it"}),
        (None, 3, None, {}),  # no tracker before this save: nothing is the previous one
        (2, 4, 8, {2: "--ckpt-keep-last 2", 6: "--ckpt-keep-last 2"}),  # multiples of 4 retained
    ],
)
def test_retention_victims(tmp_path, keep_last, retain, previous, expected):
    _make(tmp_path, *(f"iter_{it:07d}" for it in (2, 4, 6, 8, 10, 12)))
    _make(tmp_path, "iter_0000001", complete=False)  # incomplete: neither counted nor deleted
    _make(tmp_path, "iter_0000003.saving", "iter_0000005.replaced", "iter_abc", "notes")  # not ours to delete
    # 10 is the checkpoint just saved; 12 was left by a run that went further: never touched
    assert checkpoint_dirs.retention_victims(str(tmp_path), 10, previous, keep_last, retain) == expected


def test_apply_retention_deletes_the_marker_first_and_logs_one_line_each(tmp_path):
    _make(tmp_path, "iter_0000002", "iter_0000004", "iter_0000006")
    lines: list[str] = []
    deleted = checkpoint_dirs.apply_retention(str(tmp_path), 6, 4, 1, None, lines.append)
    assert deleted == [2, 4] and sorted(os.listdir(tmp_path)) == ["iter_0000006"]
    assert lines == [
        f"  deleted checkpoint {tmp_path}/iter_0000002 (--ckpt-keep-last 1)",
        f"  deleted checkpoint {tmp_path}/iter_0000004 (--ckpt-keep-last 1)",
    ]
