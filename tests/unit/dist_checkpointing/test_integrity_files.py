"""Issue 27 item 4: a checkpoint whose ``.metadata`` cannot serve its tensors (a chunk with no file, a
file not present, chunks not covering a tensor, contents listed but not saved, an empty or foreign
``.metadata``, an empty data file) is refused on load with one line naming the file and an intact
checkpoint to load instead; ``check_files`` names the same file."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatron.core.dist_checkpointing import (
    CheckpointReadError,
    ShardedTensor,
    check_files,
    load_common_state,
)
from megatron.core.dist_checkpointing.consistency import coverage_problem
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata
from megatron.training import checkpointing as ckpt

QUIET = {"log": lambda _: None}


class Optimizer:
    """Duck-typed optimizer: one moment per parameter, under ``optimizer.`` keys as the real one."""

    def __init__(self, model: nn.Module) -> None:
        self.state = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}

    def sharded_state_dict(self, model_sd: dict) -> dict:
        return {
            n: ShardedTensor(f"optimizer.state.exp_avg.{n}", t, tuple(t.shape), (0,) * t.dim())
            for n, t in self.state.items()
        }

    def load_sharded_state_dict(self, sd: dict) -> None:
        pass


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _sd(model: nn.Module) -> dict:
    """The weight saved as two blocks of rows (as two ranks would), the bias whole."""
    w = model.weight
    return {
        "w0": ShardedTensor("weight", w[:2], (4, 4), (0, 0)),
        "w1": ShardedTensor("weight", w[2:], (4, 4), (2, 0)),
        "bias": ShardedTensor("bias", model.bias, (4,), (0,)),
    }


def _save(root, iteration: int) -> None:
    model = _model()
    ckpt.save_checkpoint(
        str(root), iteration, _sd(model), Optimizer(model), extra_state={"iteration": iteration}, **QUIET
    )


def _load(root) -> dict | None:
    model = _model()
    return ckpt.load_checkpoint(str(root), _sd(model), Optimizer(model), **QUIET)


def _rewrite_metadata(ckpt_dir, change) -> None:
    """Apply ``change(md)`` to the checkpoint's DCP metadata and write it back (as a bad copy would)."""
    md = read_dcp_metadata(str(ckpt_dir))
    change(md)
    with open(os.path.join(ckpt_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _drop_chunk_storage(md) -> None:
    del md.storage_data[MetadataIndex("weight", torch.Size([2, 0]))]


def _point_at_absent_file(md) -> None:
    index = MetadataIndex("bias", torch.Size([0]))
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="__7_0.distcp")


def _drop_second_chunk(md) -> None:
    md.state_dict_metadata["weight"].chunks.pop()


def _drop_optimizer(md) -> None:
    for key in [k for k in md.state_dict_metadata if k.startswith("optimizer.")]:
        del md.state_dict_metadata[key]
    for index in [i for i in md.storage_data if i.fqn.startswith("optimizer.")]:
        del md.storage_data[index]


def _write(data: bytes):
    def damage(path) -> None:
        with open(path, "wb") as f:
            f.write(data)

    return damage


CASES = {
    "chunk without storage": (
        lambda d: _rewrite_metadata(d, _drop_chunk_storage),
        ".metadata",
        "names tensor weight but records no file holding its chunk at offset (2, 0)",
    ),
    "file not present": (lambda d: _rewrite_metadata(d, _point_at_absent_file), "__7_0.distcp", "is missing"),
    "chunks not covering": (
        lambda d: _rewrite_metadata(d, _drop_second_chunk),
        ".metadata",
        "tensor weight (4, 4): its saved chunks hold 8 of its 16 elements",
    ),
    "optimizer listed, not saved": (
        lambda d: _rewrite_metadata(d, _drop_optimizer),
        ".metadata",
        "holds no optimizer keys, though the common state lists 'optimizer'",
    ),
    "empty metadata": (lambda d: _write(b"")(d / ".metadata"), ".metadata", "is empty (0 bytes)"),
    "garbage metadata": (lambda d: _write(b"not a pickle")(d / ".metadata"), ".metadata", "cannot be read"),
    "foreign metadata": (
        lambda d: _write(pickle.dumps({"a": 1}))(d / ".metadata"),
        ".metadata",
        "cannot be read (AttributeError",
    ),
    "empty data file": (
        lambda d: _write(b"")(d / "__0_0.distcp"),
        "__0_0.distcp",
        "is truncated (0 bytes; .metadata records",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_is_refused_naming_the_file_and_an_intact_checkpoint(tmp_path, case):
    damage, file, says = CASES[case]
    _save(tmp_path, 3)
    _save(tmp_path, 6)
    assert _load(tmp_path)["iteration"] == 6  # intact before the damage
    damaged = tmp_path / "iter_0000006"
    damage(damaged)
    with pytest.raises(CheckpointReadError) as err:  # what load checks before reading a tensor
        check_files(str(damaged))
        load_common_state(str(damaged))
    assert f"{damaged / file} {says}" in str(err.value) or f"{damaged / file}: {says}" in str(err.value), (
        err.value
    )
    with pytest.raises(CheckpointReadError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(damaged / file) in msg and says in msg, msg
    assert "--ckpt-step 3 (the newest older intact one" in msg, msg
    assert _load(tmp_path / "iter_0000003")["iteration"] == 3


def test_an_empty_data_file_that_holds_nothing_is_not_damage(tmp_path):
    """A rank with nothing to write (a data-parallel replica) leaves an empty ``__{rank}_0.distcp``."""
    _save(tmp_path, 3)
    (tmp_path / "iter_0000003" / "__1_0.distcp").write_bytes(b"")
    check_files(str(tmp_path / "iter_0000003"))
    assert _load(tmp_path)["iteration"] == 3


def test_coverage_problem_tiles_exactly():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C

    def chunks(*blocks):
        return [C(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in blocks]

    assert coverage_problem((4, 4), chunks(((0, 0), (2, 4)), ((2, 0), (2, 4)))) is None
    assert coverage_problem((4, 4), chunks(((0, 0), (4, 2)), ((0, 2), (4, 2)))) is None
    assert coverage_problem((), chunks(((), ()))) is None
    assert "hold 8 of its 16" in coverage_problem((4, 4), chunks(((0, 0), (2, 4))))
    assert "outside its shape" in coverage_problem((4, 4), chunks(((0, 0), (2, 4)), ((3, 0), (2, 4))))
    # volumes add up, but two blocks overlap and a corner is missing
    assert "overlap" in coverage_problem((2, 2), chunks(((0, 0), (1, 2)), ((0, 0), (1, 1)), ((1, 1), (1, 1))))
