"""Issue 27 item 1: ``tools/checkpoint.py inspect`` (text and --json, damaged checkpoints listed, not
raised) and ``diff`` (identical, one tensor different, another flag, a key on one side only)."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil

import pytest
import torch
from torch import nn

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.torch_dist import read_dcp_metadata
from megatron.training import checkpointing as ckpt
from megatron.training.checkpoint_tool.cli import main
from megatron.training.checkpoint_tool.diff_cmd import compare
from megatron.training.checkpoint_tool.reader import SavedCheckpoint
from megatron.training.checkpoint_tool.summary import Summary
from megatron.training.cli import run as pretrain

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --mock-data --vocab-size 128 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--train-iters 4 --save-interval 2"
).split()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two pretrain_gpt.py runs (in this process): the plain optimizer, and the distributed optimizer
    saved with --no-save-optim; each saved at iterations 2 and 4."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, extra in (("plain", []), ("distopt_noopt", ["--use-distributed-optimizer", "--no-save-optim"])):
        assert pretrain(TINY + ["--save", str(root / name)] + extra) == 0
        out[name] = root / name
    return out


def _tool(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_json_agrees_with_the_saved_tensors(runs, capsys):
    rc, out, _ = _tool(capsys, "inspect", runs["plain"], "--json")
    j = json.loads(out)
    assert rc == 0 and j["problems"] == []
    assert (j["iteration"], j["consumed_train_samples"], j["consumed_valid_samples"]) == (4, 16, 0)
    assert j["floating_point_operations"] > 0 and j["finite"] is True and j["checkpoint_version"] == 3.0
    assert j["format"]["sharded_backend"] == "torch_dist"
    assert j["shape_flags"]["num_layers"] == 2 and j["shape_flags"]["hidden_size"] == 32
    assert (
        j["layout"]["tensor_model_parallel_size"] == 1 and j["layout"]["use_distributed_optimizer"] is False
    )
    assert j["layout_source"] == "args.layout"
    # Reference: every tensor read whole through the reader.
    ck = SavedCheckpoint(str(runs["plain"]))
    rows = {t["key"]: t for t in j["tensors"]}
    assert sorted(rows) == sorted(ck.tensors)
    by_group = {"model": 0, "optimizer": 0}
    for key in ck.tensors:
        t = ck.read(key)
        assert rows[key]["shape"] == list(t.shape) and rows[key]["dtype"] == str(t.dtype)[6:]
        assert rows[key]["bytes"] == t.numel() * t.element_size()
        by_group[rows[key]["group"]] += t.numel() * t.element_size()
    for o in j["objects"]:  # objects count their bytes on disk (optimizer.common is the optimizer's)
        by_group[o["group"]] = by_group.get(o["group"], 0) + o["bytes"]
    assert {k: j["bytes"][k] for k in by_group} == by_group and j["bytes"]["total"] == sum(by_group.values())
    assert [o["key"] for o in j["objects"] if o["group"] == "optimizer"] == ["optimizer.common"]
    assert sum(1 for t in j["tensors"] if t["group"] == "optimizer") == 2 * sum(
        1 for t in j["tensors"] if t["group"] == "model"
    )  # exp_avg and exp_avg_sq of every parameter
    assert j["bytes"]["other"] > 0  # RNG states and the common state
    assert j["files"] == {n: os.path.getsize(os.path.join(ck.dir, n)) for n in os.listdir(ck.dir)}


def test_inspect_text_lists_every_tensor(runs, capsys):
    rc, out, _ = _tool(capsys, "inspect", runs["distopt_noopt"], "--ckpt-step", 2)
    assert rc == 0
    assert "iteration           2" in out and "consumed samples    train 8, valid 0" in out
    assert "tensors finite      yes" in out and "  --num-layers 2" in out
    assert "distributed optimizer on" in out and "tp 1, pp 1" in out
    assert "  optimizer           0 B  (0 tensors, 0 objects)" in out  # --no-save-optim
    assert "problems            none" in out
    ck = SavedCheckpoint(str(runs["distopt_noopt"]), ckpt_step=2)
    assert "contents            model, opt_param_scheduler, rng_state" in out
    for key, (shape, _) in ck.tensors.items():
        name = key.split("layers.")[-1].split(".", 1)[-1] if "layers." in key else key.split(".", 1)[-1]
        assert any(name in ln and "[" + ", ".join(map(str, shape)) + "]" in ln for ln in out.splitlines()), (
            key
        )


def _damaged_copy(runs, tmp_path, damage):
    ck = tmp_path / "ck"
    shutil.copytree(runs["plain"], ck)
    damage(ck / "iter_0000004")
    return ck


def _drop_optimizer(d) -> None:
    md = read_dcp_metadata(str(d))
    for key in [k for k in md.state_dict_metadata if k.startswith("optimizer.")]:
        del md.state_dict_metadata[key]
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: os.truncate(d / "__0_0.distcp", 1000), "__0_0.distcp is truncated (1000 bytes"),
        (_drop_optimizer, ".metadata holds no optimizer keys"),
        (lambda d: (d / ".metadata").write_bytes(b""), ".metadata is empty (0 bytes)"),
    ],
)
def test_inspect_lists_integrity_problems_instead_of_failing(runs, tmp_path, capsys, damage, says):
    ck = _damaged_copy(runs, tmp_path, damage)
    rc, out, err = _tool(capsys, "inspect", ck, "--json")
    j = json.loads(out)
    assert rc == 1 and err == ""
    assert any(f"{ck / 'iter_0000004'}/{says}" in p for p in j["problems"]), j["problems"]
    rc, out, _ = _tool(capsys, "inspect", ck)
    assert rc == 1 and f"{ck / 'iter_0000004'}/{says}" in out


def test_inspect_of_what_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    rc, out, err = _tool(capsys, "inspect", tmp_path)
    assert (
        rc == 2 and err.count("\n") == 1 and err.startswith("checkpoint.py: error: ") and str(tmp_path) in err
    )


def test_layout_of_an_older_checkpoint_comes_from_its_config():
    config = {
        "model": {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "sequence_parallel": True,
        },
        "ddp": {"use_distributed_optimizer": True, "use_torch_fsdp2": False},
    }
    layout, source = Summary("d", 1, {}, {"args": {"config": config}}).layout()
    assert source == "args.config" and layout["tensor_model_parallel_size"] == 2
    assert layout["pipeline_model_parallel_size"] == 4 and layout["use_distributed_optimizer"] is True
    assert layout["data_parallel_size"] is None  # not recorded
    assert Summary("d", 1, {}, {}).layout() == (None, None)


# ------------------------------------------------------------------------------------------------
# diff


class _Optimizer:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.state = {n: torch.full_like(p, 0.5) for n, p in params.items()}

    def sharded_state_dict(self, model_sd: dict) -> dict:
        return {
            n: ShardedTensor(f"optimizer.state.exp_avg.{n}", t, tuple(t.shape), (0,) * t.dim())
            for n, t in self.state.items()
        }


def _save(root, params: dict[str, torch.Tensor], num_layers: int = 2, save_optim: bool = True) -> str:
    args = {
        "num_layers": num_layers,
        "config": {"model": {"num_layers": num_layers}, "checkpoint": {"save_optim": save_optim}},
    }
    sd = {n: ShardedTensor(n, p, tuple(p.shape), (0,) * p.dim()) for n, p in params.items()}
    extra = {"iteration": 5, "consumed_train_samples": 20, "args": args}
    ckpt.save_checkpoint(str(root), 5, sd, _Optimizer(params), extra_state=extra, log=lambda _: None)
    return str(root)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    return {"weight": layer.weight.detach().clone(), "bias": layer.bias.detach().clone()}


def test_diff_of_identical_checkpoints_is_exit_0(tmp_path, capsys):
    a, b = _save(tmp_path / "a", _params()), _save(tmp_path / "b", _params())
    rc, out, _ = _tool(capsys, "diff", a, b)
    assert rc == 0 and "identical: 4 tensors compared (atol 0.0, rtol 0.0)" in out, out


def test_diff_names_the_one_tensor_that_differs_and_its_difference(tmp_path, capsys):
    p = _params()
    q = {**p, "bias": p["bias"].clone()}
    q["bias"][1] += 0.25
    a, b = _save(tmp_path / "a", p), _save(tmp_path / "b", q)
    rc, out, _ = _tool(capsys, "diff", a, b)
    lines = [ln for ln in out.splitlines() if "max abs diff" in ln]
    expected_rel = 0.25 / abs(float(q["bias"][1]))
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("  bias: max abs diff 0.25,"), out
    assert math.isclose(float(lines[0].split("max rel diff ")[1]), expected_rel, rel_tol=1e-4)
    assert _tool(capsys, "diff", a, b, "--atol", 0.3)[0] == 0  # within the tolerance
    assert _tool(capsys, "diff", a, b, "--rtol", 0.9 * expected_rel)[0] == 1


def test_diff_names_flags_and_keys_that_differ(tmp_path, capsys):
    p = _params()
    a = _save(tmp_path / "a", p)
    b = _save(tmp_path / "b", {**p, "extra": torch.ones(2)}, num_layers=3, save_optim=False)
    rc, out, _ = _tool(capsys, "diff", a, b)
    assert rc == 1
    assert "  --num-layers: 2 vs 3" in out and out.count("--num-layers") == 1, out
    assert "  --no-save-optim: False vs True" in out, out  # the switch's state, not the field's
    assert "only in B (2):\n  tensor extra\n  tensor optimizer.state.exp_avg.extra" in out, out
    rc, out, _ = _tool(capsys, "diff", a, b, "--model-only")
    assert rc == 1 and "--no-save-optim" not in out and "optimizer.state" not in out and "tensor extra" in out


def test_diff_user_errors_exit_2(tmp_path, capsys):
    a = _save(tmp_path / "a", _params())
    rc, _, err = _tool(capsys, "diff", a, tmp_path / "missing")
    assert rc == 2 and err.startswith("checkpoint.py: error: ") and "missing" in err
    rc, _, err = _tool(capsys, "diff", a, a, "--atol", -1)
    assert rc == 2 and "--atol -1.0 must be >= 0" in err


def test_compare_semantics():
    x = torch.tensor([1.0, float("nan"), float("inf"), 0.0, 2.0])
    assert compare(x, x.clone(), 0.0, 0.0) == (0.0, 0.0, False)  # NaN equals NaN, inf equals inf
    y = x.clone()
    y[3] = 0.5
    max_abs, max_rel, differs = compare(y, x, 0.0, 0.0)
    assert (max_abs, max_rel, differs) == (0.5, float("inf"), True)  # relative to 0: infinite
    assert compare(torch.arange(4), torch.arange(4) + torch.tensor([0, 0, 2, 0]), 0, 0) == (
        2.0,
        0.5,
        True,
    )  # 2 / 4
