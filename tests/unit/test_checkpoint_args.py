"""--use-checkpoint-args: the architecture flags not given come from the --load checkpoint (a training
run's full config or the Hugging Face importer's architecture-only one); a given flag wins; one line
naming --use-checkpoint-args and --load when there is nothing to read."""

from __future__ import annotations

import pytest
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.training import checkpointing as ckpt
from megatron.training.loop_utils import model_args_for_check
from megatron.training.run_config import parse_run_config

RUN = "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --mock-data".split()
MODEL = (
    "--num-layers 3 --hidden-size 48 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 16 --max-position-embeddings 16 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights --vocab-size 100"
).split()


def _save(root, args: dict) -> None:
    model = nn.Linear(2, 2)
    sd = {n: ShardedTensor(n, p, tuple(p.shape), (0,) * p.dim()) for n, p in model.named_parameters()}
    extra = {"iteration": 5, "consumed_train_samples": 20, "args": args}
    ckpt.save_checkpoint(
        str(root), 5, sd, extra_state=extra, save_optim=False, save_rng=False, log=lambda _: None
    )


def _trained_args() -> dict:
    cfg = parse_run_config(RUN + MODEL)
    checks = model_args_for_check(cfg, 128)
    args = {flag.lstrip("-").replace("-", "_"): value for flag, value in checks.items()}
    return {**args, "config": cfg.to_dict(), "vocab_size": 100}


def _arch(cfg) -> tuple:
    m = cfg.model
    return (
        m.num_layers,
        m.hidden_size,
        m.num_query_groups,
        m.ffn_hidden_size,
        m.activation,
        m.normalization,
        m.add_bias_linear,
        m.position_embedding_type,
        m.rotary_base,
        m.share_embeddings_and_output_weights,
        cfg.training.seq_length,
        cfg.training.max_position_embeddings,
        cfg.tokenizer.vocab_size,
        cfg.tokenizer.padded_vocab_size,
    )


def test_fills_every_model_flag_not_given(tmp_path):
    _save(tmp_path, _trained_args())
    reference = parse_run_config(RUN + MODEL + ["--padded-vocab-size", "128"])
    cfg = parse_run_config(RUN + f"--use-checkpoint-args --load {tmp_path}".split())
    assert _arch(cfg) == _arch(reference)
    (note,) = [n for n in cfg.notes if "--use-checkpoint-args" in n]
    assert note.startswith("note: --use-checkpoint-args: ") and "iter_0000005" in note
    for flag in ("--num-layers 3", "--hidden-size 48", "--swiglu", "--untie-embeddings-and-output-weights"):
        assert flag in note
    # One checkpoint directory and --ckpt-step name the same checkpoint.
    one = parse_run_config(RUN + f"--use-checkpoint-args --load {tmp_path}/iter_0000005".split())
    assert _arch(one) == _arch(reference)


def test_a_given_flag_wins(tmp_path):
    _save(tmp_path, _trained_args())
    cfg = parse_run_config(
        RUN + f"--use-checkpoint-args --load {tmp_path} --hidden-size 64 --seq-length 8".split()
    )
    assert cfg.model.hidden_size == 64 and cfg.training.seq_length == 8
    assert cfg.model.num_layers == 3 and cfg.model.activation == "swiglu"  # the rest from the checkpoint


def test_hf_importer_checkpoint_with_architecture_only(tmp_path):
    fields = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=True,
        bias_gelu_fusion=False,
        position_embedding_type="rope",
        rotary_base=1000000,
        rope_scaling=False,
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
        share_embeddings_and_output_weights=True,
    )
    tokenizer = {"tokenizer_type": "NullTokenizer", "vocab_size": 100}
    config = {"model": fields, "training": {"max_position_embeddings": 64}, "tokenizer": tokenizer}
    _save(tmp_path, {"num_layers": 2, "padded_vocab_size": 128, "config": config, "converted_from": "/hf"})
    cfg = parse_run_config(
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --seq-length 32 --mock-data "
        f"--use-checkpoint-args --load {tmp_path}".split()
    )
    m = cfg.model
    assert (m.num_layers, m.num_query_groups, m.add_qkv_bias, m.rotary_base) == (2, 2, True, 1000000)
    assert (m.add_bias_linear, m.activation, m.layernorm_epsilon) == (False, "swiglu", 1e-6)
    assert cfg.training.max_position_embeddings == 64 and cfg.tokenizer.padded_vocab_size == 128
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer" and cfg.tokenizer.vocab_size == 100


def test_a_given_tokenizer_flag_keeps_every_tokenizer_flag(tmp_path):
    _save(tmp_path, _trained_args())
    cfg = parse_run_config(RUN + f"--use-checkpoint-args --load {tmp_path} --vocab-size 90".split())
    assert cfg.tokenizer.vocab_size == 90 and cfg.model.num_layers == 3


@pytest.mark.parametrize(
    "extra, says",
    [
        ([], "--use-checkpoint-args reads the model's flags from the --load checkpoint: pass --load DIR"),
        (["--load", "{tmp}/absent"], "--use-checkpoint-args: --load {tmp}/absent holds no checkpoint"),
    ],
)
def test_nothing_to_read_is_one_line_naming_both_flags(tmp_path, extra, says):
    with pytest.raises(ConfigError) as err:
        parse_run_config(RUN + ["--use-checkpoint-args"] + [e.format(tmp=tmp_path) for e in extra])
    assert str(err.value).startswith(says.format(tmp=tmp_path)) and "\n" not in str(err.value)
