"""pretrain_gpt.py --load <Megatron-LM torch-format dir> --ckpt-format torch: resumes at the saved iteration."""

from __future__ import annotations

import os
import sys

import pytest
from launch import ROOT, metrics
from test_pretrain import TINY

from megatron.core import dist_checkpointing
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.cli import run

sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
from test_legacy_checkpoint import megatron_args, write_megatron_checkpoint  # noqa: E402

NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0".split()


def _legacy_copy(dcp_root, legacy_root, iteration: int) -> None:
    """Megatron's torch-format files (TE spec, tp2 x pp2) of the weights, counters and schedule of one
    of our torch_dist checkpoints."""
    ckpt_dir = os.path.join(dcp_root, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state(ckpt_dir)
    a = common["args"]
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        bias_gelu_fusion=True,
        share_embeddings_and_output_weights=True,
    )  # as the training application builds it
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=a["padded_vocab_size"],
        max_sequence_length=a["max_position_embeddings"],
    )
    dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)  # fills the model in place
    args = megatron_args(
        cfg,
        tp=2,
        pp=2,
        padded_vocab_size=a["padded_vocab_size"],
        max_position_embeddings=a["max_position_embeddings"],
        consumed_train_samples=common["consumed_train_samples"],
        consumed_valid_samples=common["consumed_valid_samples"],
    )
    write_megatron_checkpoint(
        legacy_root, model, args, spec="te", iteration=iteration, scheduler=common["opt_param_scheduler"]
    )


@pytest.mark.slow
def test_resumes_from_megatron_torch_format_and_trains_on(tmp_path, capsys):
    dcp, legacy = tmp_path / "dcp", tmp_path / "legacy"
    assert (
        run(
            TINY + NO_DROPOUT + f"--train-iters 20 --save {dcp} --save-interval 10 --exit-interval 10".split()
        )
        == 0
    )
    _legacy_copy(dcp, legacy, 10)
    # The same weights and data position from our own checkpoint, optimizer fresh: the first step's loss.
    assert (
        run(
            TINY
            + NO_DROPOUT
            + f"--train-iters 20 --exit-interval 11 --load {dcp} --no-load-optim --no-load-rng "
            f"--metrics-file {tmp_path}/ref.jsonl".split()
        )
        == 0
    )
    capsys.readouterr()
    assert (
        run(
            TINY
            + NO_DROPOUT
            + f"--train-iters 20 --load {legacy} --ckpt-format torch "
            f"--metrics-file {tmp_path}/legacy.jsonl".split()
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "loading legacy torch checkpoint" in out and "optimizer state: not read" in out
    assert "successfully loaded checkpoint" in out and "at iteration 10" in out
    line = next(ln for ln in out.splitlines() if "iteration       11/      20" in ln)
    assert "consumed samples:           44" in line
    ref = metrics(f"{tmp_path}/ref.jsonl", "lm loss")
    got = metrics(f"{tmp_path}/legacy.jsonl", "lm loss")
    assert sorted(got) == list(range(11, 21)) and got[11]["lm loss"] == ref[11]["lm loss"]
    assert got[20]["lm loss"] < got[11]["lm loss"]

    assert run(TINY + f"--train-iters 20 --load {legacy} --ckpt-format torch --hidden-size 64".split()) == 2
    err = capsys.readouterr().err
    assert "--hidden-size: checkpoint 32 vs current 64" in err and "Traceback" not in err
    assert (
        run(TINY + f"--train-iters 20 --load {legacy} --save {tmp_path}/x --ckpt-format torch".split()) == 2
    )
    assert "saves are written as torch_dist only" in capsys.readouterr().err
