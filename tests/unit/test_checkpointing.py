"""Checkpoint glue: Megatron layout, tracker atomicity, interrupted saves, args check, RNG, finetune."""

from __future__ import annotations

import os
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from megatron.core.dist_checkpointing import CheckpointError, ShardedTensor
from megatron.core.dist_checkpointing import torch_dist as dcp_backend
from megatron.training import checkpointing as ckpt

ARGS = {"model": {"num_layers": 2, "hidden_size": 4, "ffn_hidden_size": [8, 8]}, "seed": 1}


def _extra(iteration: int) -> dict:
    return {
        "iteration": iteration,
        "consumed_train_samples": 10 * iteration,
        "consumed_valid_samples": 0,
        "num_floating_point_operations_so_far": 1e9,
        "args": ARGS,
        "checkpoint_version": 3.0,
    }


def _model_sd(model: nn.Module) -> dict:
    return {n: ShardedTensor(n, p, tuple(p.shape), (0,) * p.dim()) for n, p in model.named_parameters()}


class FakeOptimizer:
    """Duck-typed optimizer: one momentum tensor per parameter plus a plain step counter."""

    def __init__(self, model: nn.Module) -> None:
        self.exp_avg = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        self.step = 5
        self.loaded = False

    def sharded_state_dict(self, model_sd: dict) -> dict:
        state = {
            n: ShardedTensor(
                f"optimizer.exp_avg.{st.key}", self.exp_avg[n], st.global_shape, st.global_offset
            )
            for n, st in model_sd.items()
        }
        return {"state": state, "step": self.step}

    def load_sharded_state_dict(self, sd: dict) -> None:
        assert all(sd["state"][n] is t for n, t in self.exp_avg.items())  # filled in place
        self.step, self.loaded = sd["step"], True


class FakeScheduler:
    def __init__(self) -> None:
        self.num_steps = 100

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": 1e-3}

    def load_state_dict(self, sd: dict) -> None:
        self.num_steps = sd["num_steps"]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return model, FakeOptimizer(model), FakeScheduler()


def _save(root, iteration, model, opt, sched, **kw):
    ckpt.save_checkpoint(
        str(root), iteration, _model_sd(model), opt, sched, extra_state=_extra(iteration), **kw
    )


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = _setup()
    lines: list[str] = []
    random.seed(3)
    np.random.seed(3)
    _save(tmp_path, 100, model, opt, sched, log=lines.append)
    expected_draws = (random.random(), np.random.rand(), torch.rand(2))
    saved = (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in opt.exp_avg.items()},
    )

    assert lines[0] == f"saving checkpoint at iteration     100 to {tmp_path} in torch_dist format"
    assert re.fullmatch(
        rf"  successfully saved checkpoint from iteration     100 to {re.escape(str(tmp_path))} in \d+\.\d\d s",
        lines[1],
    ), lines
    assert len(lines) == 2
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert ckpt.read_tracker(str(tmp_path)) == 100
    assert ckpt.get_checkpoint_name(str(tmp_path), 100) == str(tmp_path / "iter_0000100")
    assert (tmp_path / "iter_0000100" / "metadata.json").is_file()

    model2, opt2, sched2 = _setup(seed=1)
    sched2.num_steps, opt2.step = 0, 0
    lines.clear()
    extra = ckpt.load_checkpoint(
        str(tmp_path),
        _model_sd(model2),
        opt2,
        sched2,
        log=lines.append,
        model_args_check={"--num-layers": 2, "--hidden-size": 4},
    )
    assert extra == _extra(100)
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v, saved[0][k], rtol=0, atol=0)
    for k, v in opt2.exp_avg.items():
        torch.testing.assert_close(v, saved[1][k], rtol=0, atol=0)
    assert opt2.loaded and opt2.step == 5 and sched2.num_steps == 100
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    torch.testing.assert_close(torch.rand(2), expected_draws[2], rtol=0, atol=0)
    assert lines == [
        f"loading checkpoint from {tmp_path} at iteration 100",
        f"  successfully loaded checkpoint from {tmp_path} at iteration 100",
    ]


def test_fresh_start_and_exit_on_missing(tmp_path):
    model, _, _ = _setup()
    lines: list[str] = []
    for d in (tmp_path / "absent", tmp_path):
        assert ckpt.load_checkpoint(str(d), _model_sd(model), log=lines.append) is None
    assert (
        lines[-1]
        == f"no checkpoint found in {tmp_path} (no latest_checkpointed_iteration.txt): starting from scratch"
    )
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint"):
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model), exit_on_missing_checkpoint=True)


def test_model_args_mismatch_lists_each_flag(tmp_path):
    model, opt, sched = _setup()
    _save(tmp_path, 10, model, opt, sched, log=lambda _: None)
    model2, _, _ = _setup(seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    check = {"--num-layers": 4, "--hidden-size": 4, "--ffn-hidden-size": (8, 16)}
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), model_args_check=check, log=lambda _: None)
    msg = str(err.value)
    assert "--num-layers: checkpoint 2 vs current 4" in msg
    assert "--ffn-hidden-size: checkpoint [8, 8] vs current (8, 16)" in msg
    assert "--hidden-size" not in msg and "iter_0000010" in msg
    for k, v in model2.state_dict().items():  # nothing was loaded
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


APP = dict(bias_gelu_fusion=True)  # the training application's default (Megatron-LM's bias-GELU fusion)


@pytest.mark.parametrize(
    "saved, kw, says",
    [
        (
            {},
            APP,
            "trained with the exact (erf) GELU (it predates the flag); this run computes Megatron-LM's tanh "
            "approximation of GELU. To keep the checkpoint's, pass --no-bias-gelu-fusion",
        ),
        ({"config": {"model": {"bias_gelu_fusion": True}}}, APP, None),
        ({"config": {"model": {"bias_gelu_fusion": False}}}, APP, "pass --no-bias-gelu-fusion"),
        (
            {},
            {},
            None,
        ),  # the library's default is Megatron-Core's exact GELU, as the old checkpoints computed
        (
            {"config": {"model": {"bias_gelu_fusion": True}}},
            dict(bias_gelu_fusion=False),
            "drop --no-bias-gelu-fusion",
        ),
        ({"config": {"model": {"bias_gelu_fusion": False}}}, dict(bias_gelu_fusion=False), None),
        ({}, dict(activation="swiglu", add_bias_linear=False), None),  # SwiGLU: no GELU to change
        ({}, dict(add_bias_linear=False), None),  # no biases: exact GELU before and after
    ],
)
def test_resuming_with_another_gelu_says_so(saved, kw, says):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.loop_utils import gelu_change_note

    model = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **kw)
    note = gelu_change_note(saved, model)
    assert (note is None) if says is None else (says in note)


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _setup()
    _save(tmp_path, 100, model, opt, sched, log=lambda _: None)
    at_100 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    original = dcp_backend._BlockSavePlanner.resolve_data
    calls = []

    def dying_resolve_data(self, item):
        calls.append(item)
        if len(calls) > 2:
            raise RuntimeError("simulated crash in the middle of writing")
        return original(self, item)

    monkeypatch.setattr(dcp_backend._BlockSavePlanner, "resolve_data", dying_resolve_data)
    with pytest.raises(
        RuntimeError, match=r"(?s)writing checkpoint .*iter_0000200\.saving failed on ranks \[0\].*simulated"
    ):
        _save(tmp_path, 200, model, opt, sched, log=lambda _: None)
    monkeypatch.setattr(dcp_backend._BlockSavePlanner, "resolve_data", original)

    assert ckpt.read_tracker(str(tmp_path)) == 100
    # the partial files lie beside the checkpoint's name, never under it
    assert not (tmp_path / "iter_0000200").exists()
    assert not (tmp_path / "iter_0000200.saving" / "metadata.json").exists()
    model2, _, _ = _setup(seed=1)
    extra = ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), log=lambda _: None)
    assert extra["iteration"] == 100
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v, at_100[k], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"(?s)iter_0000200 does not exist.*--ckpt-step 200"):
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), ckpt_step=200, log=lambda _: None)

    _save(tmp_path, 200, model, opt, sched, log=lambda _: None)  # a retry replaces the partial directory
    assert ckpt.read_tracker(str(tmp_path)) == 200 and not (tmp_path / "iter_0000200.saving").exists()
    assert ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), log=lambda _: None)["iteration"] == 200


def test_tracker_write_is_atomic_and_validated(tmp_path, monkeypatch):
    ckpt.write_tracker(str(tmp_path), 100)

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        ckpt.write_tracker(str(tmp_path), 200)
    monkeypatch.undo()
    assert ckpt.read_tracker(str(tmp_path)) == 100
    assert os.listdir(tmp_path) == ["latest_checkpointed_iteration.txt"]  # no temp file left

    model, _, _ = _setup()
    with pytest.raises(
        CheckpointError, match=r"(?s)iter_0000100 does not exist.*latest_checkpointed_iteration.txt"
    ):
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model), log=lambda _: None)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(CheckpointError, match="holds 'banana', not an iteration number"):
        ckpt.read_tracker(str(tmp_path))


def test_finetune_no_optim_and_rng_layout_change(tmp_path):
    model, opt, sched = _setup()
    _save(tmp_path, 50, model, opt, sched, log=lambda _: None, save_optim=False)
    model2, opt2, sched2 = _setup(seed=1)
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), opt2, sched2, log=lambda _: None)

    extra = ckpt.load_checkpoint(
        str(tmp_path), _model_sd(model2), opt2, sched2, finetune=True, log=lambda _: None
    )
    assert extra["iteration"] == 0 and extra["consumed_train_samples"] == 0 and extra["args"] == ARGS
    assert not opt2.loaded and sched2.num_steps == 100
    torch.testing.assert_close(model2[0].weight, model[0].weight, rtol=0, atol=0)

    lines: list[str] = []
    two_tp = SimpleNamespace(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0)
    ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), parallel_state=two_tp, log=lines.append)
    assert any(line.startswith("not loading RNG state") for line in lines)


def test_converted_checkpoint_loads_its_weights_as_iteration_0(tmp_path):
    """A checkpoint converted from another format (``converted_from``, no optimizer, RNG or scheduler
    state) continues as iteration 0 without --finetune: its weights, the optimizer untouched."""
    model, _, _ = _setup()
    extra = {**_extra(0), "converted_from": "/hf/llama"}
    ckpt.save_checkpoint(
        str(tmp_path), 0, _model_sd(model), extra_state=extra, save_optim=False, save_rng=False, log=print
    )
    model2, opt2, sched2 = _setup(seed=1)
    lines: list[str] = []
    got = ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), opt2, sched2, log=lines.append)
    assert got["iteration"] == 0 and got["converted_from"] == "/hf/llama"
    assert not opt2.loaded and sched2.num_steps == 100
    for k, v in model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)
    (note,) = [ln for ln in lines if ln.startswith("note:")]
    assert "converted from /hf/llama and holds weights only" in note and "iteration 0" in note
    # Without the marker, the same checkpoint is refused for lack of optimizer state, as before.
    ckpt.save_checkpoint(
        str(tmp_path), 1, _model_sd(model), extra_state=_extra(1), save_optim=False, save_rng=False, log=print
    )
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        ckpt.load_checkpoint(str(tmp_path), _model_sd(model2), opt2, sched2, log=lines.append)
