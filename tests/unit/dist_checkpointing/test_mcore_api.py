"""Megatron-Core 0.19.2's dist_checkpointing names, signatures and behaviour (issue 24 item 6), single process."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import core, dict_utils
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

W = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def _whole(key: str, data: torch.Tensor) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, data)


# --- core ---------------------------------------------------------------------------------------------


def test_checkpointing_exception_catches_our_errors(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointingException, match="does not exist"):
        dist_checkpointing.load({}, d)
    assert not core.check_is_distributed_checkpoint(d)
    dist_checkpointing.save({"w": _whole("w", W.clone())}, d)
    assert core.check_is_distributed_checkpoint(d)
    assert core.maybe_load_config(d) == core.CheckpointingConfig("torch_dist", 1)
    assert issubclass(dist_checkpointing.CheckpointReadError, CheckpointingException)
    assert issubclass(dist_checkpointing.CheckpointWriteError, ValueError)
    with pytest.raises(CheckpointingException, match="'missing' is not in the checkpoint"):
        dist_checkpointing.load({"x": _whole("missing", torch.zeros(2))}, d)


# --- dict_utils ---------------------------------------------------------------------------------------


def test_dict_utils():
    sd = {"a": 1, "b": {"c": "x", "d": [2, "y", {"e": 3}]}, "empty": {}}
    match, rest = dict_utils.extract_matching_values(sd, lambda v: isinstance(v, int))
    assert match == {"a": 1, "b": {"d": [2, {"e": 3}]}}
    assert rest == {"b": {"c": "x", "d": ["y"]}, "empty": {}}
    match, _ = dict_utils.extract_matching_values(
        sd, lambda v: isinstance(v, int), return_lists_as_dicts=True
    )
    assert match["b"]["d"] == {0: 2, 2: {"e": 3}}
    assert list(dict_utils.nested_values(sd)) == [1, "x", 2, "y", 3]
    assert dict_utils.dict_list_map_outplace(str, {"a": [1, (2, 3)]}) == {"a": ["1", "(2, 3)"]}
    x = {"a": [1, 2]}
    assert dict_utils.dict_list_map_inplace(lambda v: v * 10, x) is x and x == {"a": [10, 20]}
    assert dict_utils.merge({"a": {"b": 1}, "l": [{}]}, {"a": {"c": 2}, "l": [{"z": 0}]}) == {
        "a": {"b": 1, "c": 2},
        "l": [{"z": 0}],
    }
    with pytest.raises(ValueError):
        dict_utils.merge({"a": 1}, {"a": 2})
    with pytest.raises(ValueError):
        dict_utils.merge([1], [1, 2])
    left, right, mismatch = dict_utils.diff(
        {"a": torch.ones(2), "b": 1, "c": 0}, {"a": torch.zeros(2), "b": 1, "d": 0}
    )
    assert left == [("c",)] and right == [("d",)] and [m[0] for m in mismatch] == [("a",)]
    assert dict_utils.map_reduce([1, 2, 3, 4], key_fn=lambda v: v % 2, reduce_fn=sum) == {1: 4, 0: 6}


# --- mapping ------------------------------------------------------------------------------------------


def test_sharded_tensor_from_rank_offsets_and_fields():
    t = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, 1, 2), replica_id=(0, 1))
    assert (t.global_shape, t.global_offset, t.axis_fragmentations) == ((4, 6), (2, 0), (2, 1))
    assert (t.dtype, t.local_shape, t.replica_id, t.prepend_axis_num) == (torch.float32, (2, 6), (0, 1), 0)
    assert t.global_slice() == (slice(2, 4), slice(0, 6))
    assert t.local_chunk_offset_in_global() == (1, 0)
    assert t.has_regular_grid and t.max_allowed_chunks() == (2, 6)
    empty = t.without_data()
    assert empty.data is None and empty.global_shape == t.global_shape and t.data is not None
    # Megatron's positional form equals the short one
    full = ShardedTensor("w", W, torch.float32, (4, 6), (8, 6), (4, 0), None, 1)
    assert full == ShardedTensor("w", W, (8, 6), (4, 0), replica_id=1)
    p = ShardedTensor.from_rank_offsets("layers", torch.zeros(3, 4), (0, 2, 5), prepend_axis_num=1)
    assert (p.global_shape, p.global_offset, p.global_slice()) == (
        (5, 3, 4),
        (2, 0, 0),
        (2, slice(0, 3), slice(0, 4)),
    )
    with pytest.raises(CheckpointingException, match="rank offsets"):
        ShardedTensor.from_rank_offsets("w", W, (0, 2, 2))
    with pytest.raises(CheckpointingException, match="dtype"):
        ShardedTensor("w", W, torch.bfloat16, (4, 6), (4, 6), (0, 0), None)
    with pytest.raises(CheckpointingException, match="same number of axes"):
        ShardedTensor("w", W, (4, 6), (0,))
    with pytest.raises(ValueError, match="flattened_range"):
        ShardedTensor.from_rank_offsets("w", W, flattened_range=slice(0, 3))


def test_narrow_shrinks_global_shape_and_offset():
    t = ShardedTensor.from_rank_offsets("qkv", torch.zeros(6, 2), (0, 1, 2))  # global (12, 2)
    (n,) = t.narrow(0, 2, 3)
    assert (n.local_shape, n.global_shape, n.global_offset) == ((3, 2), (6, 2), (3, 0))
    assert n.data.data_ptr() == t.data[2:].data_ptr()


def test_narrow_prepend_axis_round_trip(tmp_path):
    # two ranks' [q; k] fused rows, saved as separate q and k tensors via narrow
    fused = [torch.arange(8.0).reshape(4, 2) + 100 * r for r in range(2)]
    sd = {
        f"r{r}": [
            *ShardedTensor.from_rank_offsets("q", fused[r], (0, r, 2)).narrow(0, 0, 2),
            *ShardedTensor.from_rank_offsets("k", fused[r], (0, r, 2)).narrow(0, 2, 2),
        ]
        for r in range(2)
    }
    stack = {
        "s": [
            ShardedTensor.from_rank_offsets(
                "stack", torch.full((3,), float(i)), (0, i, 2), prepend_axis_num=1
            )
            for i in range(2)
        ]
    }
    dist_checkpointing.save({**sd, **stack}, str(tmp_path))
    meta = dist_checkpointing.load_tensors_metadata(str(tmp_path))
    assert meta["q"].global_shape == (4, 2) and meta["stack"].global_shape == (2, 3)
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path))
    torch.testing.assert_close(plain["q"], torch.cat([fused[0][:2], fused[1][:2]]))
    torch.testing.assert_close(plain["k"], torch.cat([fused[0][2:], fused[1][2:]]))
    torch.testing.assert_close(plain["stack"], torch.tensor([[0.0] * 3, [1.0] * 3]))
    back = ShardedTensor.from_rank_offsets("stack", torch.zeros(3), (0, 1, 2), prepend_axis_num=1)
    out = dist_checkpointing.load({"b": back}, str(tmp_path))
    assert out["b"] is back.data and (back.data == 1.0).all()


def test_sharded_object_grid(tmp_path):
    objs = [ShardedObject("rng", f"state{i}", (2,), (i,), replica_id=0) for i in range(2)]
    assert objs[1].unique_key == "rng/shard_1_2" and str(objs[1]) == "ShardedObject(key='rng')"
    assert ShardedObject.empty_from_unique_key("rng/shard_1_2") == objs[1].without_data()
    with pytest.raises(CheckpointingException):
        ShardedObject("o", 1, (2,), ())
    with pytest.raises(ValueError, match=r"object rng: 1 of the 2 shards"):
        dist_checkpointing.save({"o": objs[0]}, str(tmp_path / "partial"))
    dist_checkpointing.save({"o": objs}, str(tmp_path))
    out = dist_checkpointing.load({"one": ShardedObject("rng", None, (2,), (1,))}, str(tmp_path))
    assert out == {"one": "state1"}
    assert set(dist_checkpointing.load_sharded_metadata(str(tmp_path))) == {"rng/shard_0_2", "rng/shard_1_2"}


def _split_build(key, data, replica_id, flattened_range):
    return {
        "lo": ShardedTensor.from_rank_offsets(f"{key}.lo", data[:2], replica_id=replica_id),
        "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", data[2:], replica_id=replica_id),
    }


def _split_merge(sub):
    return torch.cat([sub["lo"], sub["hi"]])


def test_factory_saved_as_built_and_merged_on_load(tmp_path):
    factory = ShardedTensorFactory("w", W.clone(), _split_build, _split_merge)
    sd = {"model": {"w": factory}}
    dist_checkpointing.save(sd, str(tmp_path))
    assert sd["model"]["w"] is factory  # save does not change the caller's dict
    assert set(dist_checkpointing.load_tensors_metadata(str(tmp_path))) == {"w.lo", "w.hi"}
    out = dist_checkpointing.load(
        {"model": {"w": ShardedTensorFactory("w", torch.zeros(4, 6), _split_build, _split_merge)}},
        str(tmp_path),
    )
    torch.testing.assert_close(out["model"]["w"], W)
    built = {"w": ShardedTensorFactory("w", W, _split_build, _split_merge)}
    apply_factories(built)
    assert set(built["w"]) == {"lo", "hi"}
    assert torch.equal(apply_factory_merges({"w": {"lo": W[:2], "hi": W[2:]}}, {"w": factory})["w"], W)


def test_local_nonpersistent_object_not_saved(tmp_path):
    dist_checkpointing.save(
        {"w": _whole("w", W.clone()), "local": LocalNonpersistentObject("saved?")}, str(tmp_path)
    )
    assert "local" not in dist_checkpointing.load_common_state_dict(str(tmp_path))
    out = dist_checkpointing.load(
        {"w": _whole("w", torch.zeros(4, 6)), "local": LocalNonpersistentObject(7)}, str(tmp_path)
    )
    assert out["local"] == 7


def test_content_metadata(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dist_checkpointing.save(
        {"w": _whole("w", W.clone())}, a, content_metadata={"format": 2, "fused_qkv": True}
    )
    assert dist_checkpointing.load_content_metadata(a) == {"format": 2, "fused_qkv": True}
    loaded = dist_checkpointing.load({"w": _whole("w", torch.zeros(4, 6))}, a)
    assert dist_checkpointing.load_content_metadata(preloaded_state_dict=loaded) == {
        "format": 2,
        "fused_qkv": True,
    }
    dist_checkpointing.save({"w": _whole("w", W.clone())}, b)
    assert dist_checkpointing.load_content_metadata(b) is None
    with pytest.raises(ValueError):
        dist_checkpointing.load_content_metadata()


# --- strict -------------------------------------------------------------------------------------------


def test_strict_handling_members_and_parse():
    assert {m.name: m.value for m in StrictHandling} == {
        "ASSUME_OK_UNEXPECTED": "assume_ok_unexpected",
        "LOG_UNEXPECTED": "log_unexpected",
        "LOG_ALL": "log_all",
        "RAISE_UNEXPECTED": "raise_unexpected",
        "RAISE_ALL": "raise_all",
        "RETURN_UNEXPECTED": "return_unexpected",
        "RETURN_ALL": "return_all",
        "IGNORE_ALL": "ignore_all",
    }
    assert parse_strict_flag("log_all") is StrictHandling.LOG_ALL
    assert parse_strict_flag(StrictHandling.RAISE_ALL) is StrictHandling.RAISE_ALL
    assert parse_strict_flag(True) is StrictHandling.ASSUME_OK_UNEXPECTED
    assert parse_strict_flag(False) is StrictHandling.LOG_UNEXPECTED
    with pytest.raises(ValueError, match="strict='nope'.*'raise_all'"):
        parse_strict_flag("nope")
    assert StrictHandling.requires_returning_mismatch_keys(StrictHandling.RETURN_UNEXPECTED)
    assert not StrictHandling.requires_global_app_metadata(StrictHandling.LOG_UNEXPECTED)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of tensors 'a' and 'b' and plain value 'p'."""
    d = str(tmp_path_factory.mktemp("strict"))
    dist_checkpointing.save({"a": _whole("a", W.clone()), "b": _whole("b", W.clone()), "p": 1}, d)
    return d


def _request():
    # 'b' is missing (saved, not requested); 'x' (tensor) and 'q' (plain value) are unexpected
    return {"a": _whole("a", torch.zeros(4, 6)), "x": _whole("x", torch.zeros(2)), "q": 5}


def test_plain_value_never_saved_is_not_returned(saved):
    out = dist_checkpointing.load({"a": _whole("a", torch.zeros(4, 6)), "q": 5, "n": {"r": [1, 2]}}, saved)
    assert out.keys() == {"a", "p"} and out["p"] == 1


def test_strict_default_raises_on_unexpected_tensor(saved):
    with pytest.raises(CheckpointingException, match="'x' is not in the checkpoint"):
        dist_checkpointing.load(_request(), saved)


@pytest.mark.parametrize("mode,logged", [("log_unexpected", False), ("log_all", True)])
def test_strict_log(saved, caplog, mode, logged):
    with caplog.at_level(logging.WARNING, logger="megatron.core.dist_checkpointing"):
        out = dist_checkpointing.load(_request(), saved, strict=mode)
    assert out.keys() == {"a", "p"}
    torch.testing.assert_close(out["a"], W)
    text = caplog.text
    assert "'x'" in text and "'q'" in text and ("'b'" in text) == logged


@pytest.mark.parametrize(
    "mode,missing", [(StrictHandling.RAISE_UNEXPECTED, False), (StrictHandling.RAISE_ALL, True)]
)
def test_strict_raise(saved, mode, missing):
    request = _request()
    with pytest.raises(CheckpointingException) as err:
        dist_checkpointing.load(request, saved, strict=mode)
    text = str(err.value)
    assert (
        "unexpected key 'x'" in text
        and "unexpected key 'q'" in text
        and ("missing key 'b'" in text) == missing
    )
    assert (request["a"].data == 0).all()  # raised before reading


@pytest.mark.parametrize(
    "mode,missing", [(StrictHandling.RETURN_UNEXPECTED, set()), (StrictHandling.RETURN_ALL, {"b"})]
)
def test_strict_return(saved, mode, missing):
    out, missing_keys, unexpected_keys = dist_checkpointing.load(_request(), saved, strict=mode)
    assert (missing_keys, unexpected_keys) == (missing, {"x", "q"})
    assert out.keys() == {"a", "p"}


def test_strict_ignore_all(saved, caplog):
    with caplog.at_level(logging.WARNING):
        out = dist_checkpointing.load(_request(), saved, strict=StrictHandling.IGNORE_ALL)
    assert out.keys() == {"a", "p"} and caplog.text == ""


# --- save / load options and strategies ----------------------------------------------------------------


def test_strategies_and_signatures(tmp_path):
    d = str(tmp_path)
    save_strategy = get_default_save_sharded_strategy()
    assert isinstance(save_strategy, TorchDistSaveShardedStrategy)
    assert (save_strategy.backend, save_strategy.version) == ("torch_dist", 1)
    assert isinstance(get_default_load_sharded_strategy(d), TorchDistLoadShardedStrategy)
    dist_checkpointing.save({"w": _whole("w", W.clone())}, d, FullyParallelSaveStrategyWrapper(save_strategy))
    target = _whole("w", torch.zeros(4, 6))
    out = dist_checkpointing.load(
        {"w": target}, d, FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(d))
    )
    assert out["w"] is target.data and torch.equal(target.data, W)
    with pytest.raises(ValueError, match="'zarr'"):
        get_default_save_sharded_strategy("zarr")
    with pytest.raises(ConfigError, match="async_sharded_save=True"):
        dist_checkpointing.save({"w": _whole("w", W.clone())}, d, async_sharded_save=True)
    with pytest.raises(ConfigError, match="sharded_strategy"):
        dist_checkpointing.save({"w": _whole("w", W.clone())}, d, ("zarr", 1))


def test_validate_access_integrity_false_skips_coverage(tmp_path):
    half = {"w": ShardedTensor.from_rank_offsets("w", W[:2].clone(), (0, 0, 2))}
    with pytest.raises(CheckpointingException, match="cover 12 of 24"):
        dist_checkpointing.save(half, str(tmp_path / "a"))
    dist_checkpointing.save(half, str(tmp_path / "b"), validate_access_integrity=False)
    target = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, 0, 2))
    dist_checkpointing.load({"w": target}, str(tmp_path / "b"), validate_access_integrity=False)
    assert torch.equal(target.data, W[:2])


def test_verify_integrity(tmp_path):
    d = str(tmp_path)
    dist_checkpointing.save({"w": _whole("w", W.clone())}, d, verify_integrity=True)
    dist_checkpointing.load({"w": _whole("w", torch.zeros(4, 6))}, d, verify_integrity=True)
    (data_file,) = [f for f in os.listdir(d) if f.endswith(".distcp")]
    with open(os.path.join(d, data_file), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(dist_checkpointing.CheckpointReadError, match=f"{data_file}: SHA-256"):
        dist_checkpointing.load({"w": _whole("w", torch.zeros(4, 6))}, d, verify_integrity=True)
    dist_checkpointing.save({"w": _whole("w", W.clone())}, d)  # a later save without a manifest removes it
    with pytest.raises(CheckpointingException, match="integrity.json is missing"):
        dist_checkpointing.load({"w": _whole("w", torch.zeros(4, 6))}, d, verify_integrity=True)


def test_utils_split_and_rename():
    from megatron.core.dist_checkpointing import utils

    sd = {
        "w": _whole("decoder.w", W),
        "o": ShardedObject("decoder.o", 1),
        "n": LocalNonpersistentObject(2),
        "p": 3,
    }
    tensors, rest = utils.extract_sharded_tensors(sd)
    assert set(tensors) == {"w"} and set(rest) == {"o", "n", "p"}
    assert set(utils.extract_sharded_base(sd)[0]) == {"w", "o"}
    assert set(utils.extract_nonpersistent(sd)[0]) == {"n"}
    utils.replace_prefix_for_sharding(sd, "decoder.", "model.decoder.")
    assert (sd["w"].key, sd["o"].key) == ("model.decoder.w", "model.decoder.o")
    utils.apply_prefix_mapping(sd, {"model.decoder.w": "x.w", "nothing": "y"})
    utils.add_prefix_for_sharding(sd, "top.")
    assert (sd["w"].key, sd["o"].key) == ("top.x.w", "top.model.decoder.o")
    with pytest.raises(ValueError, match="does not start with 'decoder.'"):
        utils.replace_prefix_for_sharding(sd, "decoder.", "")


def test_strategy_save_and_load_directly(tmp_path):
    d = str(tmp_path)
    TorchDistSaveShardedStrategy().save({"w": _whole("w", W.clone()), "it": 5}, d)
    assert dist_checkpointing.check_is_distributed_checkpoint(d)
    assert dist_checkpointing.load_common_state_dict(d) == {"it": 5}
    target = _whole("w", torch.zeros(4, 6))
    out = TorchDistLoadShardedStrategy().load({"w": target}, d)
    assert torch.equal(out["w"], W)
    meta = get_default_load_sharded_strategy(d).load_sharded_metadata(d)
    assert meta["w"].data is None and meta["w"].global_shape == (4, 6) and meta["w"].dtype == torch.float32
