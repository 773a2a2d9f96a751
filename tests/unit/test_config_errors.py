"""ConfigError carries the parameters its message names; the application rewrites them to flags."""

import pickle

import pytest

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.errors import DataError
from megatron.core.dist_checkpointing.errors import CheckpointError


def test_config_error_is_a_value_error_with_params():
    err = ConfigError(
        "hidden_size (100) is not divisible by num_attention_heads (3)",
        params=("hidden_size", "num_attention_heads"),
    )
    assert isinstance(err, ValueError)
    assert err.params == ("hidden_size", "num_attention_heads")
    assert str(err) == "hidden_size (100) is not divisible by num_attention_heads (3)"
    assert ConfigError("plain message").params == ()


def test_config_error_keeps_params_across_pickling():
    err = pickle.loads(pickle.dumps(ConfigError("seq_length must be > 0, got 0", params=["seq_length"])))
    assert (
        type(err) is ConfigError
        and err.params == ("seq_length",)
        and str(err) == "seq_length must be > 0, got 0"
    )


# ------------------------------------------------------------------- the application's flag names
def test_flag_of_reads_field_metadata_aliases_datasets_and_megatron_dests():
    from megatron.training.user_errors import flag_of

    assert flag_of("tensor_model_parallel_size") == ("--tensor-model-parallel-size", None)
    assert flag_of("layernorm_epsilon") == ("--norm-epsilon", None)  # doc(flag=...)
    assert flag_of("sequence_parallel") == ("--sequence-parallel", True)  # a switch that sets True
    assert flag_of("cross_entropy_loss_fusion") == (
        "--no-cross-entropy-loss-fusion",
        False,
    )  # app default True
    assert flag_of("add_bias_linear") == ("--disable-bias-linear", False)  # set only by an alias
    assert flag_of("sequence_length") == ("--seq-length", None)  # GPTDatasetConfig's name
    assert flag_of("num_moe_experts") == ("--num-experts", None)  # doc(flag=...) of an MoE field
    assert flag_of("moe_router_force_biased") == (
        "--moe-router-force-biased",
        None,
    )  # a Megatron-LM flag that is not our field
    assert flag_of("apply_rope_fusion") == (
        "--no-rope-fusion",
        False,
    )  # Megatron-LM's dest of --no-rope-fusion
    assert flag_of("activation_func") is None  # no flag sets it: the message keeps the name


def test_flag_message_rewrites_the_listed_parameters_only():
    from megatron.training.user_errors import flag_message

    err = ConfigError(
        "num_attention_heads 3 does not divide hidden_size 100 (hidden_size_x, "
        "TransformerConfig.kv_channels=8); set sequence_parallel=True or "
        "cross_entropy_loss_fusion=False, recompute_granularity='full', add_bias_linear=True",
        params=(
            "num_attention_heads",
            "hidden_size",
            "kv_channels",
            "sequence_parallel",
            "cross_entropy_loss_fusion",
            "recompute_granularity",
            "add_bias_linear",
        ),
    )
    assert flag_message(err) == (
        "--num-attention-heads 3 does not divide --hidden-size 100 (hidden_size_x, --kv-channels 8); set "
        "--sequence-parallel or --no-cross-entropy-loss-fusion, --recompute-granularity full, "
        "no --disable-bias-linear"
    )
    assert flag_message(ConfigError("hidden_size 100 is odd")) == "hidden_size 100 is odd"  # no params
    assert flag_message(ValueError("hidden_size 100")) == "hidden_size 100"  # not ours: as raised
    lib = ConfigError("lr must be >= 0, got -1", params=("lr",))
    assert flag_message(lib) == "--lr must be >= 0, got -1" and str(lib) == "lr must be >= 0, got -1"


def test_the_library_names_the_parameter_and_the_application_the_flag():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.arguments import parse_run_config

    with pytest.raises(ConfigError, match=r"^num_attention_heads 3 does not divide hidden_size 64") as e:
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=3)
    assert "num_attention_heads" in e.value.params and "hidden_size" in e.value.params
    with pytest.raises(ConfigError, match=r"^--num-attention-heads 3 does not divide --hidden-size 64"):
        parse_run_config(CLI + ["--num-attention-heads", "3"])


# ------------------------------------------------------------------- cli.run: user error or bug
CLI = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 128 --num-workers 0"
).split()


@pytest.mark.parametrize(
    "error",
    [
        ConfigError(
            "tensor_model_parallel_size 3 does not divide 4 ranks", params=("tensor_model_parallel_size",)
        ),
        DataError("data file 'x.bin' is truncated"),
        CheckpointError("checkpoint ck/iter_0000002 has no model weights"),
    ],
)
def test_cli_prints_a_user_error_once_in_flags_and_exits_2(monkeypatch, capsys, error):
    from megatron.training import cli, training

    def pretrain(cfg, providers):
        raise error

    monkeypatch.setattr(training, "pretrain", pretrain)
    assert cli.run(CLI) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    expected = str(error).replace("tensor_model_parallel_size", "--tensor-model-parallel-size")
    assert err.strip().splitlines() == [f"pretrain_gpt.py: error: {expected}"]


def test_cli_lets_a_bare_value_error_through_with_its_traceback(monkeypatch):
    """Raised on out of ``run``, so that Python prints its traceback and exits 1 (not a one-line exit 2)."""
    from megatron.training import cli, training

    def pretrain(cfg, providers):
        raise ValueError("Expected input batch_size (4) to match target batch_size (2).")  # torch's, a bug

    monkeypatch.setattr(training, "pretrain", pretrain)
    with pytest.raises(ValueError, match="Expected input batch_size"):
        cli.run(CLI)


def test_a_tool_maps_parameters_to_its_own_parsers_flags():
    import argparse

    from megatron.training.param_flags import parser_flags, rewrite_params

    p = argparse.ArgumentParser()
    p.add_argument("--vocab-file")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--no-mmap", dest="mmap", action="store_false")
    flags = parser_flags(p)
    assert (flags("vocab_file"), flags("append_eod"), flags("mmap"), flags("seed")) == (
        ("--vocab-file", None),
        ("--append-eod", True),
        ("--no-mmap", False),
        None,
    )
    assert rewrite_params(
        "vocab_file is required (append_eod=True, mmap=False, seed 3)",
        ("vocab_file", "append_eod", "mmap", "seed"),
        flags,
    ) == ("--vocab-file is required (--append-eod, --no-mmap, seed 3)")


def test_ckpt_keep_last_needs_save_and_a_positive_count(capsys):
    from megatron.training import cli

    assert cli.run(CLI + ["--ckpt-keep-last", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pretrain_gpt.py: error: --ckpt-keep-last 2 needs --save (it deletes older checkpoints of --save); "
        "pass --save DIR or drop --ckpt-keep-last"
    )
    assert cli.run(CLI + ["--ckpt-keep-last", "0", "--save", "ck"]) == 2
    assert "--ckpt-keep-last" in capsys.readouterr().err
