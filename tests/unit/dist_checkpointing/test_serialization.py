"""Single-process tests of dist_checkpointing save/load: round trip, resharding, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

FULL = torch.arange(48, dtype=torch.float32).reshape(6, 8)  # [rows, cols]


def _full(key: str, data: torch.Tensor) -> ShardedTensor:
    return ShardedTensor(key, data, tuple(data.shape), (0,) * data.dim())


def test_round_trip_nested_dtypes_objects(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "i64": torch.arange(7),
        "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    sd = {
        "model": {name: _full(f"model.{name}", t.clone()) for name, t in tensors.items()},
        "obj": ShardedObject("obj", {"a": [1, 2], "b": (3, "x")}),
        "iteration": 42,
        "nested": {"plain": [1, 2.0, "three"], "mixed": [ShardedObject("in_list", "v"), 5]},
    }
    dist_checkpointing.save(sd, str(tmp_path), common_state={"args": {"num_layers": 2}})
    assert json.loads((tmp_path / "metadata.json").read_text())["sharded_backend"] == "torch_dist"

    request = {
        "model": {name: _full(f"model.{name}", torch.zeros_like(t)) for name, t in tensors.items()},
        "obj": ShardedObject("obj", None),
        "iteration": 0,
        "nested": {"mixed": [ShardedObject("in_list", None), 0]},
    }
    out = dist_checkpointing.load(request, str(tmp_path))
    for name, t in tensors.items():
        assert out["model"][name] is request["model"][name].data  # loaded in place
        torch.testing.assert_close(out["model"][name], t, rtol=0, atol=0)
    assert out["obj"] == {"a": [1, 2], "b": (3, "x")}
    assert out["iteration"] == 42 and out["args"] == {"num_layers": 2}
    assert out["nested"] == {"plain": [1, 2.0, "three"], "mixed": ["v", 5]}
    assert dist_checkpointing.load_common_state(str(tmp_path))["iteration"] == 42


def test_reshard_full_to_blocks_and_back(tmp_path):
    full_dir, blocks_dir = str(tmp_path / "full"), str(tmp_path / "blocks")
    dist_checkpointing.save({"w": _full("w", FULL.clone())}, full_dir)

    # load as two row halves and two column halves (what two ranks would ask for)
    halves = [ShardedTensor.from_rank_offsets("w", torch.zeros(3, 8), (0, r, 2)) for r in range(2)]
    cols = [ShardedTensor.from_rank_offsets("w", torch.zeros(6, 4), (1, r, 2)) for r in range(2)]
    dist_checkpointing.load({"h": halves, "c": cols}, full_dir)
    for r in range(2):
        torch.testing.assert_close(halves[r].data, FULL[3 * r : 3 * r + 3])
        torch.testing.assert_close(cols[r].data, FULL[:, 4 * r : 4 * r + 4])

    # save as a 2x2 grid of blocks, uneven offsets on load
    grid = [
        ShardedTensor("w", FULL[r0:r1, c0:c1].clone(), (6, 8), (r0, c0))
        for r0, r1 in ((0, 2), (2, 6))
        for c0, c1 in ((0, 5), (5, 8))
    ]
    dist_checkpointing.save({"grid": grid}, blocks_dir)
    whole = _full("w", torch.zeros(6, 8))
    odd = ShardedTensor("w", torch.zeros(3, 3), (6, 8), (1, 4))
    dist_checkpointing.load({"a": whole, "b": odd}, blocks_dir)
    torch.testing.assert_close(whole.data, FULL)
    torch.testing.assert_close(odd.data, FULL[1:4, 4:7])


def test_allow_shape_mismatch_reads_overlap(tmp_path):
    dist_checkpointing.save({"emb": _full("emb", FULL.clone())}, str(tmp_path))
    padded = torch.full((8, 8), -1.0)  # padded vocabulary: rows 6, 7 keep their values
    st = ShardedTensor("emb", padded, (8, 8), (0, 0), allow_shape_mismatch=True)
    dist_checkpointing.load({"emb": st}, str(tmp_path))
    torch.testing.assert_close(padded[:6], FULL)
    assert (padded[6:] == -1).all()


def test_coverage_validation_on_save(tmp_path):
    gap = {"w": ShardedTensor("w", torch.zeros(3, 8), (6, 8), (0, 0))}
    with pytest.raises(ValueError, match=r"w: main replicas cover 24 of 48"):
        dist_checkpointing.save(gap, str(tmp_path / "a"))
    overlap = {
        "w": [
            ShardedTensor("w", torch.zeros(4, 8), (6, 8), (0, 0)),
            ShardedTensor("w", torch.zeros(4, 8), (6, 8), (2, 0)),
        ]
    }
    with pytest.raises(ValueError, match="overlap"):
        dist_checkpointing.save(overlap, str(tmp_path / "b"))
    two_objects = {"a": ShardedObject("o", 1), "b": ShardedObject("o", 2)}
    with pytest.raises(ValueError, match="object o: 2 main replicas"):
        dist_checkpointing.save(two_objects, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "a" / "metadata.json")


def test_load_errors_name_dir_and_key(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=f"{d} does not exist"):
        dist_checkpointing.load({}, d)
    dist_checkpointing.save({"w": _full("w", FULL.clone())}, d)
    with pytest.raises(ValueError, match=rf"(?s){d}.*'missing' is not in the checkpoint"):
        dist_checkpointing.load({"x": _full("missing", torch.zeros(2))}, d)
    with pytest.raises(
        ValueError, match=r"(?s)ckpt.*w: global shape in checkpoint \(6, 8\) != requested \(6, 9\)"
    ):
        dist_checkpointing.load({"w": _full("w", torch.zeros(6, 9))}, d)
    out = dist_checkpointing.load({"x": _full("missing", torch.zeros(2))}, d, strict=False)
    assert "x" not in out

    os.remove(os.path.join(d, "metadata.json"))
    with pytest.raises(ValueError, match=f"incomplete checkpoint {d}: no metadata.json"):
        dist_checkpointing.load({"w": _full("w", torch.zeros(6, 8))}, d)
