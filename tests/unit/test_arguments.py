"""The flag list (snapshot), flag-to-config mapping and user-error messages."""

import os

import pytest
import torch

from megatron.training.arguments import build_parser, configs_from_namespace, flag_list, parse_run_config
from megatron.training.validation import validate_run_config

SNAPSHOT = os.path.join(os.path.dirname(__file__), "snapshots", "pretrain_gpt_flags.txt")
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()


def test_flag_snapshot():
    """Every new or renamed flag is a visible diff: regenerate the snapshot deliberately."""
    with open(SNAPSHOT) as f:
        expected = f.read().split()
    assert flag_list() == expected


def test_megatron_spellings_present():
    flags = set(flag_list())
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--group-query-attention",
        "--num-query-groups",
        "--kv-channels",
        "--ffn-hidden-size",
        "--normalization",
        "--norm-epsilon",
        "--swiglu",
        "--disable-bias-linear",
        "--qk-layernorm",
        "--position-embedding-type",
        "--rotary-base",
        "--rotary-percent",
        "--hidden-dropout",
        "--attention-dropout",
        "--init-method-std",
        "--untie-embeddings-and-output-weights",
        "--make-vocab-size-divisible-by",
        "--seq-length",
        "--max-position-embeddings",
        "--micro-batch-size",
        "--global-batch-size",
        "--train-iters",
        "--train-samples",
        "--lr",
        "--min-lr",
        "--lr-decay-style",
        "--lr-warmup-iters",
        "--lr-warmup-fraction",
        "--lr-warmup-samples",
        "--lr-decay-iters",
        "--lr-decay-samples",
        "--weight-decay",
        "--start-weight-decay",
        "--end-weight-decay",
        "--weight-decay-incr-style",
        "--clip-grad",
        "--optimizer",
        "--adam-beta1",
        "--adam-beta2",
        "--adam-eps",
        "--bf16",
        "--fp16",
        "--loss-scale",
        "--initial-loss-scale",
        "--min-loss-scale",
        "--loss-scale-window",
        "--hysteresis",
        "--seed",
        "--mock-data",
        "--tokenizer-type",
        "--vocab-size",
        "--eval-interval",
        "--eval-iters",
        "--log-interval",
        "--save",
        "--load",
        "--save-interval",
        "--no-load-optim",
        "--no-load-rng",
        "--finetune",
        "--exit-interval",
        "--exit-duration-in-mins",
        "--exit-signal-handler",
        "--tensorboard-dir",
        "--wandb-project",
        "--wandb-exp-name",
        "--wandb-save-dir",
    ):
        assert flag in flags, flag


def test_flags_map_onto_configs():
    cfg = parse_run_config(
        BASE
        + "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --bf16 "
        "--group-query-attention --num-query-groups 2 --normalization RMSNorm --norm-epsilon 1e-6 "
        "--no-load-optim --global-batch-size 8".split()
    )
    m = cfg.model
    assert (m.activation, m.add_bias_linear, m.share_embeddings_and_output_weights) == (
        "swiglu",
        False,
        False,
    )
    assert m.params_dtype == torch.bfloat16 and cfg.optimizer.bf16 and m.num_query_groups == 2
    assert m.layernorm_epsilon == 1e-6 and cfg.checkpoint.load_optim is False
    assert cfg.training.global_batch_size == 8 and cfg.tokenizer.tokenizer_type == "NullTokenizer"


def test_defaults_follow_megatron():
    cfg = parse_run_config(BASE)
    assert cfg.model.hidden_dropout == 0.1 and cfg.model.init_method_std == 0.02
    assert cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.clip_grad == 1.0
    assert cfg.optimizer.initial_loss_scale == 2.0**32 and cfg.optimizer.hysteresis == 2
    assert cfg.training.seed == 1234 and cfg.training.make_vocab_size_divisible_by == 128
    assert cfg.scheduler.lr_decay_style == "linear" and cfg.logger.log_interval == 100


BAD = [
    ("--num-attention-heads 6", "--num-attention-heads 6 does not divide --hidden-size 64"),
    ("--global-batch-size 7", "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    ("--fp16 --bf16", "--fp16 and --bf16 cannot be used together"),
    ("--train-samples 100", "exactly one of --train-iters or --train-samples"),
    ("--num-query-groups 2", "--num-query-groups only takes effect with --group-query-attention"),
    ("--lr-decay-samples 100", "--lr-decay-samples needs --train-samples"),
    ("--save-interval 5", "--save-interval needs --save"),
    ("--loss-scale 128", "--loss-scale only applies with --fp16"),
    ("--transformer-impl transformer_engine", "--transformer-impl local"),
    ("--seq-length 64 --max-position-embeddings 32", "--seq-length 64 exceeds --max-position-embeddings 32"),
    ("--hidden-dropout 1.5", "--hidden-dropout must be in"),
    ("--lr-decay-style WSD", "--lr-wsd-decay-iters"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_user_errors_name_the_flag(extra, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_run_config(BASE + extra.split())


def test_null_tokenizer_needs_vocab_size():
    argv = [a for a in BASE if a not in ("--vocab-size", "128")] + ["--tokenizer-type", "NullTokenizer"]
    with pytest.raises(ValueError, match="--vocab-size"):
        parse_run_config(argv)


def test_batch_check_uses_world_size():
    ns = vars(build_parser().parse_args(BASE + ["--global-batch-size", "6"]))
    cfg = configs_from_namespace(ns)
    with pytest.raises(ValueError, match="data-parallel size 2"):
        validate_run_config(cfg, world_size=2)


def test_unknown_flag_one_line_with_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        parse_run_config(BASE + ["--num-layer", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean --num-layers" in err[0]


def test_megatron_compat_flags_are_accepted_without_effect():
    """Flags asking for what this package always does (Megatron-LM scripts pass them) change nothing
    and are noted once each."""
    compat = [
        "--use-mcore-models",
        "--use-flash-attn",
        "--attention-softmax-in-fp32",
        "--log-memory-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--attention-backend",
        "flash",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion",
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--accumulate-allreduce-grads-in-fp32",
    ]
    cfg = parse_run_config(BASE + compat)
    assert cfg.to_dict() == parse_run_config(BASE).to_dict()
    assert all(flag in " ".join(cfg.notes) for flag in compat if flag.startswith("--"))


def test_gelu_flags_follow_megatron():
    approx = lambda extra: parse_run_config(BASE + extra).model.gelu_approximation  # noqa: E731
    assert approx([]) == "tanh"  # biased GELU MLP: Megatron-LM's bias-GELU fusion, the tanh approximation
    assert approx(["--no-bias-gelu-fusion"]) == "none"
    assert approx(["--disable-bias-linear"]) == "none"
    assert approx(["--swiglu"]) == "none"


def test_megatron_compat_flags_asking_for_something_else_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_run_config(BASE + ["--attention-backend", "unfused"])
    assert "--attention-backend unfused: attention always runs through" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match="--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16"
    ):
        parse_run_config(BASE + ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"])


def test_megatron_position_embedding_spellings():
    pos = lambda extra: parse_run_config(BASE + extra).model.position_embedding_type  # noqa: E731
    assert pos(["--use-rotary-position-embeddings"]) == "rope"
    assert pos(["--position-embedding-type", "rope", "--no-position-embedding"]) == "rope"
    assert pos(["--use-rotary-position-embeddings", "--no-position-embedding"]) == "rope"
    assert pos(["--no-position-embedding"]) == "none"
    assert pos([]) == "learned_absolute"
    with pytest.raises(
        ValueError, match="--use-rotary-position-embeddings contradicts --position-embedding-type none"
    ):
        pos(["--use-rotary-position-embeddings", "--position-embedding-type", "none"])


def test_expert_flags_reach_the_model_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    m = parse_run_config(
        BASE
        + "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-2".split()
    ).model
    assert (m.num_moe_experts, m.moe_router_topk, m.expert_model_parallel_size) == (4, 2, 2)
    assert (m.moe_aux_loss_coeff, m.moe_router_load_balancing_type) == (1e-2, "aux_loss")


def test_context_parallel_flags_reach_the_model_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    m = parse_run_config(BASE + ["--context-parallel-size", "2", "--attention-dropout", "0"]).model
    assert (m.context_parallel_size, m.cp_comm_type, m.hierarchical_context_parallel_sizes) == (
        2,
        ["p2p"],
        None,
    )
    hcp = "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --attention-dropout 0"
    m = parse_run_config(BASE + hcp.split()).model
    assert (m.cp_comm_type, m.hierarchical_context_parallel_sizes) == (["a2a+p2p"], [2, 2])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--non-persistent-save-interval", "5"],
            "--non-persistent-save-interval 5: non-persistent (local) checkpoints are not built",
        ),
        (
            ["--moe-use-upcycling"],
            "--moe-use-upcycling: upcycling a dense checkpoint into experts is not built",
        ),
        (
            ["--checkpoint-activations", "--non-persistent-save-interval", "5"],
            "--checkpoint-activations: Megatron-LM removed it; use --recompute-granularity full",
        ),
        (["--fp8-output-proj", "--num-layer", "3"], "--fp8-output-proj: this FP8 setting is not built"),
    ],
)
def test_megatron_flags_not_taken_get_one_line_saying_what_to_do(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        parse_run_config(BASE + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert expected in "\n".join(err)
    flags = [a for a in argv if a.startswith("--")]
    assert len(err) == (1 if len(flags) == 1 else 1 + len(flags))  # one line, or a header and one per mistake
    if "--use-torch-fsdp2" in argv:
        assert "--use-torch-fsdp2: FSDP is not built yet; --use-distributed-optimizer" in err[2]
    if "--num-layer" in argv:  # a plain typo beside it is still named
        assert (
            "--num-layer: not a flag of pretrain_gpt.py nor of Megatron-LM 0.19.2; did you mean --num-layers?"
            in err[2]
        )


def test_flag_reference_is_current():
    """docs/flags.md is generated from the parser; regenerate it with tools/flag_reference.py."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    spec = importlib.util.spec_from_file_location(
        "flag_reference", os.path.join(root, "tools", "flag_reference.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(root, "docs", "flags.md")) as f:
        assert f.read() == module.render(), "run: python tools/flag_reference.py > docs/flags.md"


def test_overlap_p2p_communication_is_on_by_default_and_can_be_turned_off():
    assert parse_run_config(BASE).model.overlap_p2p_comm is True
    assert parse_run_config(BASE + ["--no-overlap-p2p-communication"]).model.overlap_p2p_comm is False


def test_compiled_layers_are_accepted_under_tensor_parallelism(monkeypatch):
    """Compiled tp2 + SP layers equal eager ones on NCCL (tests/distributed/test_compile.py) and train."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (
        parse_run_config(
            BASE + "--tensor-model-parallel-size 2 --torch-compile on".split()
        ).impl.torch_compile
        == "on"
    )
    assert parse_run_config(BASE + "--tensor-model-parallel-size 2".split()).impl.torch_compile == "auto"


def test_gradients_are_aliased_only_for_the_optimizer_that_reads_them_in_place():
    """The one-pass AdamW reads bf16 gradients as they are; with fp16 loss scaling or another
    optimizer they would be widened into new fp32 tensors, so DDP keeps its fp32 buffer there."""
    assert parse_run_config(BASE).ddp.alias_single_gradients is True
    assert parse_run_config(BASE + ["--fp16"]).ddp.alias_single_gradients is False
    assert parse_run_config(BASE + ["--optimizer", "sgd"]).ddp.alias_single_gradients is False


def test_overlap_param_gather_needs_the_distributed_optimizer_and_overlapped_reduction(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        parse_run_config(BASE + ["--overlap-param-gather", "--use-distributed-optimizer"])
    cfg = parse_run_config(
        BASE + "--overlap-param-gather --use-distributed-optimizer --overlap-grad-reduce".split()
    )
    assert cfg.ddp.overlap_param_gather


def test_grad_reduce_in_bf16_needs_bf16():
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 needs --bf16"):
        parse_run_config(BASE + ["--grad-reduce-in-bf16"])
    assert parse_run_config(BASE + ["--bf16", "--grad-reduce-in-bf16"]).ddp.grad_reduce_in_fp32 is False
    assert parse_run_config(BASE + ["--bf16"]).ddp.grad_reduce_in_fp32 is True


def test_virtual_stage_errors_name_the_uneven_split(monkeypatch):
    """26 layers on 4 pipeline ranks: --num-layers-per-virtual-pipeline-stage cannot apply (and says what
    can); --virtual-pipeline-model-parallel-size with first/last stage sizes can."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert BASE[:2] == ["--num-layers", "2"]
    base = ["--num-layers", "26"] + BASE[2:] + ["--global-batch-size", "16"]
    with pytest.raises(
        ValueError, match="divisible by --pipeline-model-parallel-size .4.; for an uneven split"
    ):
        parse_run_config(
            base + "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2".split()
        )
    with pytest.raises(ValueError, match="does not divide the --num-layers 24"):
        parse_run_config(
            ["--num-layers", "24"]
            + base[2:]
            + "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4".split()
        )
    cfg = parse_run_config(
        base
        + (
            "--pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2 "
            "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4"
        ).split()
    )
    assert cfg.model.virtual_pipeline_model_parallel_size == 2


def test_saved_config_holds_no_per_process_addresses():
    """The config saved in every checkpoint is common state that each rank writes: the hooks the trainer
    sets (bound methods, functions) appear by name, never with a memory address that differs per rank."""

    class Wrapper:
        def no_sync(self):
            pass

    cfg = parse_run_config(BASE)
    cfg.model.no_sync_func = [Wrapper().no_sync, Wrapper().no_sync]
    cfg.model.finalize_model_grads_func = test_saved_config_holds_no_per_process_addresses
    text = repr(cfg.to_dict())
    assert " at 0x" not in text and "Wrapper.no_sync" in text
