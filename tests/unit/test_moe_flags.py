"""Megatron-LM's MoE flags: accepted with Megatron's defaults into TransformerConfig's moe_* fields,
the rest refused with a reason, and one test per mistake: a ``ConfigError`` from
``parse_run_config`` naming the flag, and through the entry point (``cli.run``) one stderr line
and exit code 2. No process is spawned: the world size is the launcher's ``WORLD_SIZE``."""

from __future__ import annotations

import re

import pytest

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.moe_config_fields import moe_layer_pattern, parse_moe_layer_freq
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import cli
from megatron.training.arguments import parse_run_config

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()
MOE = "--num-experts 4 --moe-router-topk 2".split()


@pytest.fixture
def world(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))

    set_world(1)
    return set_world


def test_megatron_defaults(world):
    m = parse_run_config(BASE + ["--num-experts", "8"]).model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_layer_freq, m.moe_ffn_hidden_size) == (8, 2, 1, 256)
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (
        "aux_loss",
        0.0,
        None,
    )
    assert (m.moe_router_score_function, m.moe_token_dispatcher_type, m.moe_token_drop_policy) == (
        "softmax",
        "allgather",
        "probs",
    )
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (1, 1)
    assert m.moe_router_bias_update_rate == 1e-3 and m.moe_expert_capacity_factor is None
    assert parse_run_config(BASE).model.num_moe_experts is None


def test_every_built_flag_reaches_its_field(world):
    world(4)
    argv = (
        BASE
        + (
            "--num-experts 8 --moe-ffn-hidden-size 32 --moe-layer-freq [0]*1+[1]*3 --moe-router-topk 4 "
            "--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 4 "
            "--moe-router-group-topk 2 --moe-router-dtype fp64 --moe-router-load-balancing-type seq_aux_loss "
            "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-router-enable-expert-bias "
            "--moe-router-bias-update-rate 1e-2 --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity "
            "--moe-token-drop-policy position --moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap "
            "--moe-shared-expert-gate "
            "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
            "--expert-tensor-parallel-size 2 --moe-per-layer-logging --moe-input-jitter-eps 0.01 --disable-bias-linear"
        ).split()
    )
    m = parse_run_config(argv).model
    assert m.moe_layer_freq == [0, 1, 1, 1] and moe_layer_pattern(m) == [False, True, True, True]
    assert (m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_router_score_function) == (32, 4, "sigmoid")
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_dtype) == (4, 2, "fp64")
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (
        "seq_aux_loss",
        1e-2,
        1e-3,
    )
    assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 1e-2
    assert (m.moe_expert_capacity_factor, m.moe_pad_expert_input_to_capacity, m.moe_token_drop_policy) == (
        1.5,
        True,
        "position",
    )
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_overlap, m.moe_grouped_gemm) == (
        64,
        True,
        True,
    )
    assert (m.moe_token_dispatcher_type, m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (
        "alltoall",
        2,
        2,
    )
    assert (
        m.moe_per_layer_logging and m.moe_input_jitter_eps == 0.01 and m.moe_router_topk_scaling_factor == 2.5
    )


def test_fusion_flags_are_noted_without_effect(world):
    cfg = parse_run_config(BASE + MOE + ["--moe-router-fusion", "--moe-permute-fusion"])
    assert any("--moe-router-fusion, --moe-permute-fusion: accepted, no effect here" in n for n in cfg.notes)


def test_layer_freq_is_parsed_not_evaluated():
    assert parse_moe_layer_freq("[0]*1+[1]*3") == [0, 1, 1, 1]
    assert parse_moe_layer_freq("[1, 0]*2") == [1, 0, 1, 0]
    assert parse_moe_layer_freq("2") == 2
    for text in ("__import__('os').getcwd()", "[0]*n", "[0.5]*4", "[0]**4", "(lambda: [1])()"):
        with pytest.raises(ValueError):
            parse_moe_layer_freq(text)
    pattern = TransformerConfig(
        num_layers=6, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_layer_freq=2
    )
    assert moe_layer_pattern(pattern) == [True, False, True, False, True, False]


def test_library_config_takes_megatron_core_moe_fields():
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=1e-2,
        moe_shared_expert_intermediate_size=128,
        moe_grouped_gemm=True,
    )
    assert cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size == 256
    with pytest.raises(ConfigError, match=r"moe_router_topk 9 exceeds num_moe_experts 8; use at most 8"):
        TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=9
        )
    with pytest.raises(ConfigError, match="need sequence_parallel"):
        TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_moe_experts=8,
            tensor_model_parallel_size=2,
        )


# (world size, flags, what the one line says: a regex naming the flag and the way out)
MISTAKES = {
    "topk above experts": (
        1,
        "--num-experts 4 --moe-router-topk 5",
        r"--moe-router-topk 5 exceeds --num-experts 4; use at most 4",
    ),
    "experts not divisible by ep": (
        4,
        "--num-experts 6 --expert-model-parallel-size 4",
        r"--num-experts 6 is not divisible by --expert-model-parallel-size 4; .*e\.g\. 3\)",
    ),
    "world not divisible by etp x ep x pp": (
        6,
        "--num-experts 4 --expert-model-parallel-size 4",
        r"world size 6 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 .*"
        r"e\.g\. --expert-model-parallel-size 2",
    ),
    "layer freq list of the wrong length": (
        1,
        "--num-experts 4 --moe-layer-freq [0]*1+[1]*2",
        r"--moe-layer-freq \[0, 1, 1\] must give one 0 \(dense\) or 1 \(MoE\) per layer: --num-layers 4 entries",
    ),
    "layer freq not a list expression": (
        1,
        "--num-experts 4 --moe-layer-freq every2",
        r"--moe-layer-freq every2: not a valid",
    ),
    "moe flag without experts": (
        1,
        "--moe-ffn-hidden-size 32",
        r"--moe-ffn-hidden-size only apply to MoE layers; set --num-experts \(e\.g\. 8\)",
    ),
    "group topk without groups": (
        1,
        "--num-experts 8 --moe-router-group-topk 2",
        r"group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk",
    ),
    "groups not dividing experts": (
        1,
        "--num-experts 8 --moe-router-num-groups 3 --moe-router-group-topk 1",
        r"--moe-router-num-groups 3 does not divide --num-experts 8",
    ),
    "group topk above groups": (
        1,
        "--num-experts 8 --moe-router-num-groups 2 --moe-router-group-topk 3",
        r"--moe-router-group-topk 3 exceeds --moe-router-num-groups 2",
    ),
    "topk outside the chosen groups": (
        1,
        "--num-experts 8 --moe-router-num-groups 4 --moe-router-group-topk 1 --moe-router-topk 4",
        r"--moe-router-topk 4 with --moe-router-group-topk 1 groups of 2 experts: k must be a multiple of 1 up to 2",
    ),
    "tensor parallel without sequence parallel": (
        2,
        "--num-experts 4 --tensor-model-parallel-size 2",
        r"MoE layers with --tensor-model-parallel-size 2 need --sequence-parallel",
    ),
    "expert bias with softmax": (
        1,
        "--num-experts 4 --moe-router-enable-expert-bias",
        r"--moe-router-enable-expert-bias .* needs --moe-router-score-function sigmoid \(or sqrtsoftplus\)",
    ),
    "pad to capacity without capacity": (
        1,
        "--num-experts 4 --moe-pad-expert-input-to-capacity",
        r"--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    ),
    "shared expert overlap with allgather": (
        1,
        "--num-experts 4 --moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap",
        r"--moe-shared-expert-overlap .* needs --moe-token-dispatcher-type alltoall",
    ),
    "flex dispatcher": (
        1,
        "--num-experts 4 --moe-token-dispatcher-type flex",
        r"--moe-token-dispatcher-type flex: choose one of allgather, alltoall",
    ),
    "sinkhorn balancing": (
        1,
        "--num-experts 4 --moe-router-load-balancing-type sinkhorn",
        r"--moe-router-load-balancing-type sinkhorn: choose one of aux_loss, seq_aux_loss, global_aux_loss, none",
    ),
    "coefficients not one per balancing type": (
        1,
        "--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 1e-3 1e-4",
        r"--moe-aux-loss-coeff 0\.01 0\.001 0\.0001 gives 3 coefficients for 2 --moe-router-load-balancing-type values",
    ),
    "expert ffn not divisible by etp": (
        2,
        "--num-experts 4 --moe-ffn-hidden-size 33 --expert-tensor-parallel-size 2 --disable-bias-linear",
        r"--moe-ffn-hidden-size 33 is not divisible by --expert-tensor-parallel-size 2",
    ),
    "expert biases over expert-tp": (
        2,
        "--num-experts 4 --expert-tensor-parallel-size 2",
        r"--expert-tensor-parallel-size 2 with no --disable-bias-linear: expert biases split over expert-tp "
        r"are not built; set --disable-bias-linear",
    ),
    "a refused MoE flag": (
        1,
        "--num-experts 4 --moe-enable-deepep",
        r"--moe-enable-deepep: the flex dispatcher .* use --moe-token-dispatcher-type alltoall",
    ),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_an_moe_mistake_is_one_line_naming_the_flag(name, world, capsys):
    size, flags, says = MISTAKES[name]
    world(size)
    argv = BASE + flags.split()
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_run_config(argv)
    if e.type is ConfigError:
        assert re.search(says, str(e.value)), str(e.value)
    capsys.readouterr()
    try:
        code = cli.run(argv)
    except SystemExit as stop:  # a mistake of the flags themselves stops the parser
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: ")
    assert re.search(says, err[0]), err[0]


def test_valid_neighbours_are_taken(world):
    """The mistakes' nearest valid neighbours pass (each check refuses only its own mistake)."""
    for size, flags in (
        (4, "--num-experts 8 --expert-model-parallel-size 4"),
        (6, "--num-experts 4 --expert-model-parallel-size 2"),
        (1, "--num-experts 4 --moe-layer-freq [0]*1+[1]*3"),
        (1, "--num-experts 8 --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk 4"),
        (2, "--num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel --disable-bias-linear"),
        (1, "--num-experts 4 --moe-router-enable-expert-bias --moe-router-score-function sigmoid"),
        (1, "--num-experts 4 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"),
        (
            1,
            "--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 1e-3",
        ),
        (
            1,
            "--num-experts 4 --moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap --moe-token-dispatcher-type alltoall",
        ),
        (2, "--num-experts 4 --moe-ffn-hidden-size 32 --expert-tensor-parallel-size 2 --disable-bias-linear"),
    ):
        world(size)
        assert parse_run_config(BASE + flags.split()).model.num_moe_experts


def test_megatron_mixtral_example_flags_are_taken(world):
    """examples/mixtral/train_mixtral_8x7b_distributed.sh's model, MoE and parallel flags (sizes scaled
    to 4 processes, pp2 x ep2; mock data instead of its tokenizer and corpus)."""
    world(4)
    argv = (
        "--disable-bias-linear --seq-length 64 --max-position-embeddings 128 --num-layers 4 --hidden-size 64 "
        "--ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0 "
        "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
        "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
        "--no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000 "
        "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
        "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
        "--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 20 --lr-decay-iters 16 "
        "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 2 --clip-grad 1.0 --bf16 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
        "--use-distributed-optimizer --sequence-parallel --log-interval 1 --eval-interval 10 --eval-iters 1 "
        "--no-load-optim --no-load-rng --mock-data --vocab-size 128"
    ).split()
    cfg = parse_run_config(argv)
    m = cfg.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_token_dispatcher_type, m.moe_grouped_gemm) == (
        8,
        2,
        "alltoall",
        True,
    )
    assert (m.expert_model_parallel_size, m.pipeline_model_parallel_size, m.moe_ffn_hidden_size) == (
        2,
        2,
        224,
    )
    assert not m.sequence_parallel  # tp 1: turned off with a note, as Megatron-LM does
