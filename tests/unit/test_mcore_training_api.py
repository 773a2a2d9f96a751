"""Megatron-LM's two-step argument contract (megatron.training.arguments.parse_args / validate_args)
and megatron.training.global_vars."""

import sys

import pytest
import torch

from megatron.training import global_vars
from megatron.training.arguments import parse_args, parse_run_config, validate_args

FULL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()


@pytest.fixture
def argv(monkeypatch):
    def set_argv(flags):
        monkeypatch.setattr(sys, "argv", ["train.py"] + list(flags))

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return set_argv


def test_partial_flags_parse_then_validate_names_the_missing_flag(argv):
    argv(["--num-layers", "2"])
    args = parse_args()
    assert args.num_layers == 2
    # Not given: None where Megatron-LM requires it, the default elsewhere; nothing derived yet.
    assert args.hidden_size is None and args.lr is None and args.data_path is None
    assert args.tensor_model_parallel_size == 1 and args.weight_decay == 0.01 and args.add_bias_linear is True
    assert args.rank == 0 and args.world_size == 1
    assert not hasattr(args, "data_parallel_size")
    with pytest.raises(ValueError, match="--hidden-size is required"):
        validate_args(args)


def test_validate_fills_derived_values(argv):
    argv(FULL + ["--swiglu", "--bf16"])
    args = validate_args(parse_args())
    assert args.data_parallel_size == 1 and args.transformer_pipeline_model_parallel_size == 1
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron-LM's SwiGLU size
    assert args.kv_channels == 16 and args.global_batch_size == 2  # micro-batch x data-parallel size
    assert args.params_dtype == torch.bfloat16 and args.encoder_seq_length == 32
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert args.consumed_train_samples == 0 and args.variable_seq_lengths is False
    assert args.run_config.model.activation == "swiglu"


def test_validate_uses_the_namespace_world_size_and_edits(argv):
    argv(FULL + ["--tensor-model-parallel-size", "2"])
    args = parse_args()
    args.world_size = 8
    args.micro_batch_size = 1
    validate_args(args)
    assert args.data_parallel_size == 4 and args.global_batch_size == 4
    assert args.sequence_parallel is False


def test_validate_defaults_fill_only_missing(argv):
    argv([f for f in FULL if f not in ("--lr", "1e-3")])
    args = validate_args(parse_args(), defaults={"lr": 3e-4, "num_layers": 7})
    assert args.lr == 3e-4 and args.num_layers == 2


def test_megatron_dest_names(argv):
    argv(FULL + "--disable-bias-linear --no-load-optim --apply-layernorm-1p --no-position-embedding".split())
    args = parse_args()
    assert args.add_bias_linear is False and args.no_load_optim is True and args.no_save_optim is None
    assert args.layernorm_zero_centered_gamma is True and args.add_position_embedding is False
    cfg = validate_args(args).run_config
    assert cfg.model.add_bias_linear is False and cfg.checkpoint.load_optim is False


def test_a_megatron_name_set_before_validating_is_taken(argv):
    argv(FULL)
    args = parse_args()
    args.add_bias_linear = False
    assert validate_args(args).run_config.model.add_bias_linear is False


def test_validate_matches_parse_run_config(argv):
    flags = FULL + "--swiglu --global-batch-size 8 --lr-decay-style cosine --norm-epsilon 1e-6".split()
    argv(flags)
    assert validate_args(parse_args()).run_config.to_dict() == parse_run_config(flags).to_dict()


def test_ignore_unknown_args(argv, capsys):
    argv(FULL + ["--not-a-flag", "3"])
    with pytest.raises(SystemExit) as e:
        parse_args()
    assert e.value.code == 2 and "--not-a-flag" in capsys.readouterr().err
    assert parse_args(ignore_unknown_args=True).num_layers == 2


def test_ignore_unknown_args_still_refuses_refused_flags(argv):
    argv(FULL + ["--moe-enable-deepep"])
    with pytest.raises(SystemExit):
        parse_args(ignore_unknown_args=True)


def test_extra_args_provider(argv):
    def extra(parser):
        group = parser.add_argument_group(title="mine")
        group.add_argument("--my-knob", type=int, default=5)
        group.add_argument("--my-switch", action="store_true")
        return parser

    argv(FULL + ["--my-knob", "9"])
    args = parse_args(extra_args_provider=extra)
    assert args.my_knob == 9 and args.my_switch is False
    assert validate_args(args).my_knob == 9


def test_global_vars_set_get():
    global_vars.unset_global_variables()
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()
    ns = object()
    global_vars.set_args(ns)
    assert global_vars.get_args() is ns
    global_vars.unset_global_variables()


def test_megatron_flags_that_are_not_ours_have_their_dests(argv):
    argv(FULL)
    args = parse_args()
    # Megatron-LM's defaults, read by code written against its args (--num-experts is refused here).
    assert args.num_experts is None and args.manual_gc is False and args.deprecated_use_mcore_models is False
    assert (
        args.manual_gc_interval == 0 and args.context_parallel_size == 1 and args.tp_comm_overlap_ag is True
    )
    argv(
        FULL
        + "--manual-gc --manual-gc-interval 5 --use-mcore-models --disable-tp-comm-overlap-ag "
        "--context-parallel-size 1".split()
    )
    args = parse_args()
    assert (
        args.manual_gc is True and args.manual_gc_interval == 5 and args.deprecated_use_mcore_models is True
    )
    assert args.tp_comm_overlap_ag is False and args.context_parallel_size == 1
    assert validate_args(args).data_parallel_size == 1
