"""Cross-config checks, one named function each. Each raises ConfigError naming the flag(s) and a
valid value; single-config checks live in the configs' own ``__post_init__``."""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.utils import parse_and_normalize_split
from megatron.core.fusions.fp8 import fp8_emulated
from megatron.core.num_microbatches_calculator import check_rampup
from megatron.core.pipeline_parallel.interleaved import check_interleaving
from megatron.core.transformer.context_parallel.layout import COMM_TYPES
from megatron.training.checkpoint_dirs import check_save_dir
from megatron.training.loop_utils import build_batch_calculator, build_scheduler, train_iters_of
from megatron.training.validation_moe import check_experts


def world_size_from_env() -> int:
    """The launcher's world size (torchrun / SLURM), known before any process group exists."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def planned_world_size(cfg) -> int:
    """The world size a run is validated for: ``--world-size`` if given (a dry run plans for it), else the
    launcher's. A real run given ``--world-size`` must be launched with that many processes."""
    launcher = world_size_from_env()
    given = cfg.training.world_size
    if given is None:
        return launcher
    if not cfg.training.dry_run and given != launcher:
        raise ConfigError(
            f"--world-size {given} differs from the {launcher} process(es) this run was launched with; "
            f"drop --world-size (it plans --dry-run runs) or launch {given} processes"
        )
    return given


def data_parallel_size(cfg, world_size: int) -> int:
    """world / (tp x pp x cp): context-parallel ranks share their samples, they are not data-parallel."""
    m = cfg.model
    return world_size // (
        m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    )


def check_batch_sizes(cfg, world_size: int) -> None:
    t, m = cfg.training, cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        cp_text = f" x --context-parallel-size {cp}" if cp > 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}{cp_text}; use sizes whose product divides {world_size}"
        )
    dp = data_parallel_size(cfg, world_size)
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        good = max(1, round(t.global_batch_size / (t.micro_batch_size * dp))) * t.micro_batch_size * dp
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}; use e.g. --global-batch-size {good}"
        )
    if t.rampup_batch_size is not None:
        start, increment, ramp_samples = (int(v) for v in t.rampup_batch_size)
        check_rampup(start, increment, ramp_samples, t.global_batch_size)
    if cfg.checkpoint.load is None:  # a resumed run is checked from its consumed samples on (Trainer)
        check_batch_schedule(cfg, dp, 0)


def batch_schedule_flag(cfg) -> str:
    """The flag that sets the global batch size schedule, as the user wrote it."""
    t = cfg.training
    if t.rampup_batch_size is not None:
        return "--rampup-batch-size " + " ".join(str(v) for v in t.rampup_batch_size)
    if t.step_batch_size_schedule is not None:
        return f"--step-batch-size-schedule {t.step_batch_size_schedule!r}"
    return f"--global-batch-size {t.global_batch_size}"


def check_batch_schedule(cfg, dp: int, consumed_samples: int) -> None:
    """Every global batch size the schedule still uses from ``consumed_samples`` on is a multiple of
    --micro-batch-size x ``dp`` (a ramp's first sizes need not divide a layout it resumes on)."""
    t = cfg.training
    unit = t.micro_batch_size * dp
    for size in build_batch_calculator(cfg, dp).batch_sizes_from(consumed_samples):
        if size % unit:
            raise ConfigError(
                f"{batch_schedule_flag(cfg)}: global batch size {size} is not divisible by --micro-batch-size "
                f"{t.micro_batch_size} x data-parallel size {dp}; use batch sizes (a ramp's start and increment) "
                f"that are multiples of {unit}"
            )


def check_training_length(cfg, world_size: int) -> None:
    """At least one step to train: the LR schedule's length is the run's. (Megatron-LM skips its loop at
    --train-iters 0 but asserts a decay length > 0 unless --lr-decay-iters is given; --skip-train is
    the evaluation-only run, here as there.)"""
    t = cfg.training
    batches = build_batch_calculator(cfg, data_parallel_size(cfg, world_size))
    if train_iters_of(cfg, batches) > 0:
        return
    evaluate = (
        "; --skip-train still builds the run's learning-rate schedule, which needs the run's length"
        if t.skip_train
        else "; to evaluate a checkpoint without training, keep the run's length and add --skip-train --load DIR"
    )
    if t.train_iters is not None:
        raise ConfigError(
            f"--train-iters {t.train_iters} trains nothing; give 1 or more (e.g. --train-iters 1000)"
            + evaluate
        )
    first = batches.running_batch_size(batches.global_batch_size_at(0))
    raise ConfigError(
        f"--train-samples {t.train_samples} is less than the first step's global batch of {first} samples "
        f"and trains nothing; give --train-samples {first} or more" + evaluate
    )


def check_pipeline(cfg, world_size: int) -> None:
    """Interleaving's micro-batch rules, and data features later pipeline stages cannot see."""
    m, t, d = cfg.model, cfg.training, cfg.data
    pp = m.pipeline_model_parallel_size
    if pp == 1:
        return
    if d.reset_attention_mask:
        raise ConfigError(
            "--reset-attention-mask is not supported with --pipeline-model-parallel-size > 1 "
            "(later stages never see the batch); drop it or use --pipeline-model-parallel-size 1"
        )
    if d.reset_position_ids and m.position_embedding_type == "rope":
        raise ConfigError(
            "--reset-position-ids with --position-embedding-type rope is not supported with "
            "--pipeline-model-parallel-size > 1 (later stages rotate by positions 0..s-1)"
        )
    if m.virtual_pipeline_model_parallel_size:
        dp = data_parallel_size(cfg, world_size)
        for size in build_batch_calculator(cfg, dp).batch_sizes_from(0):  # each step's count must fit
            check_interleaving(
                size // (t.micro_batch_size * dp), pp, m.microbatch_group_size_per_virtual_pipeline_stage
            )


def check_sequence(cfg) -> None:
    t, m = cfg.training, cfg.model
    if m.sequence_parallel and t.seq_length % m.tensor_model_parallel_size != 0:
        raise ConfigError(
            f"--sequence-parallel needs --seq-length ({t.seq_length}) divisible by "
            f"--tensor-model-parallel-size {m.tensor_model_parallel_size}"
        )
    if m.position_embedding_type == "learned_absolute" and t.seq_length > t.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {t.seq_length} exceeds --max-position-embeddings {t.max_position_embeddings}; "
            f"set --max-position-embeddings {t.seq_length} or more"
        )


def _comm_types(cfg) -> list[str]:
    """--cp-comm-type as a list of one entry per layer or one for all (checked)."""
    m = cfg.model
    types = m.cp_comm_type or ["p2p"]
    types = [types] if isinstance(types, str) else list(types)
    if len(types) not in (1, m.num_layers):
        raise ConfigError(
            f"--cp-comm-type has {len(types)} values; give one for every layer (e.g. --cp-comm-type p2p) "
            f"or one per layer (--num-layers {m.num_layers} values)"
        )
    for t in types:
        if t not in COMM_TYPES:
            raise ConfigError(
                f"--cp-comm-type {t}: not one of {', '.join(COMM_TYPES)}; e.g. --cp-comm-type p2p"
            )
    return types


def check_context_parallel(cfg) -> None:
    """--context-parallel-size and its comm types: the sequence splits into 2 x cp chunks, all-to-all
    splits heads over the cp (or first hierarchical level's) ranks, a2a+p2p needs its two levels."""
    m, t = cfg.model, cfg.training
    cp, tp, hcp = m.context_parallel_size, m.tensor_model_parallel_size, m.hierarchical_context_parallel_sizes
    example = f"2 {cp // 2}" if cp % 2 == 0 else f"{cp} 1"  # two levels multiplying to cp
    if hcp and (len(hcp) != 2 or math.prod(hcp) != cp):
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))}: give two sizes (the a2a "
            f"level, then the p2p level) whose product is --context-parallel-size {cp}, e.g. "
            f"--hierarchical-context-parallel-sizes {example}"
        )
    if cp == 1:
        return
    if t.seq_length % (2 * cp):
        good = max(1, round(t.seq_length / (2 * cp))) * 2 * cp
        raise ConfigError(
            f"--seq-length {t.seq_length} does not split into 2 x --context-parallel-size {cp} = {2 * cp} "
            f"equal chunks; use a multiple of {2 * cp} (e.g. --seq-length {good})"
        )
    if m.attention_dropout > 0:
        raise ConfigError(
            f"--attention-dropout {m.attention_dropout} with --context-parallel-size {cp}: dropout on the "
            "attention probabilities is not built for context-parallel attention; pass --attention-dropout 0"
        )
    types = set(_comm_types(cfg))
    if "a2a+p2p" in types and not hcp:
        raise ConfigError(
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (all-to-all over A "
            f"consecutive cp ranks, ring over P of them; A x P = --context-parallel-size {cp}), e.g. "
            f"--hierarchical-context-parallel-sizes {example}"
        )
    # All-to-all hands each rank of its group whole heads (and whole query groups) of this tp rank.
    heads, groups = m.num_attention_heads // tp, (m.num_query_groups or m.num_attention_heads) // tp
    splits = {"a2a": (cp, f"--context-parallel-size {cp}")}
    if hcp:
        splits["a2a+p2p"] = (hcp[0], f"the a2a level {hcp[0]} of --hierarchical-context-parallel-sizes")
    for kind, (size, over) in splits.items():
        if kind in types and (groups % size or heads % size):
            raise ConfigError(
                f"--cp-comm-type {kind} splits the attention heads over {over}: the {heads} heads and "
                f"{groups} query groups per tensor-parallel rank (--num-attention-heads / --num-query-groups / "
                f"--tensor-model-parallel-size {tp}) must be divisible by {size}; use --cp-comm-type p2p"
            )
    if hcp and "a2a+p2p" not in types:
        cfg.notes.append(
            "note: --hierarchical-context-parallel-sizes has no effect without --cp-comm-type a2a+p2p "
            "(its groups are built, as in Megatron-LM, and unused)"
        )


def check_schedule_units(cfg) -> None:
    t, s = cfg.training, cfg.scheduler
    if t.train_iters is not None:
        for name in ("lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples"):
            if getattr(s, name):
                raise ConfigError(
                    f"--{name.replace('_', '-')} needs --train-samples; with --train-iters use "
                    f"--{name.replace('_samples', '_iters').replace('_', '-')}"
                )
    else:
        for name in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters"):
            if getattr(s, name):
                raise ConfigError(
                    f"--{name.replace('_', '-')} needs --train-iters; with --train-samples use "
                    f"--{name.replace('_iters', '_samples').replace('_', '-')}"
                )
    if s.lr_decay_style == "WSD" and not (s.lr_wsd_decay_iters or s.lr_wsd_decay_samples):
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")


def check_optimizer(cfg) -> None:
    o = cfg.optimizer
    if o.lr is None:
        raise ConfigError("--lr is required (e.g. --lr 3e-4)")
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} is larger than --lr {o.lr}; use a value <= {o.lr}")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        raise ConfigError(
            "--decoupled-min-lr only applies with --decoupled-lr; add --decoupled-lr or drop it"
        )
    if o.loss_scale is not None and not cfg.model.fp16:
        raise ConfigError(
            "--loss-scale only applies with --fp16; drop it (bf16 and fp32 need no loss scaling)"
        )
    d = cfg.ddp
    sharded = d.use_distributed_optimizer or d.fsdp_sharding() is not None
    if d.overlap_param_gather and not (sharded and d.overlap_grad_reduce):
        raise ConfigError(
            "--overlap-param-gather needs --use-distributed-optimizer (or FSDP) and --overlap-grad-reduce; "
            "add both or drop --overlap-param-gather"
        )


def check_split(cfg) -> None:
    """--split holds 1 to 3 non-negative shares. The dataset reads any separator and so would read
    ``-1,50,50`` as ``1,50,50``: a minus before a share (not between two, as in ``90-5-5``) is refused."""
    split = cfg.data.split
    if split is None:
        return
    if re.search(r"(?:^|[^.0-9])-\s*[.0-9]", split):
        raise ConfigError(
            f"--split {split}: a share is negative; give non-negative proportions of train, validation "
            "and test, e.g. --split 969,30,1"
        )
    parse_and_normalize_split(split)  # raises naming --split


def check_data_and_tokenizer(cfg) -> None:
    d, tok = cfg.data, cfg.tokenizer
    if not (d.mock_data or d.data_path or d.train_data_path):
        raise ConfigError(
            "no training data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data"
        )
    if tok.tokenizer_type is None:
        if tok.vocab_file and tok.merge_file:  # Megatron-LM's gpt3 example passes these two and no type
            tok.tokenizer_type = "GPT2BPETokenizer"
            cfg.notes.append(
                "note: --tokenizer-type GPT2BPETokenizer, the tokenizer of --vocab-file with "
                "--merge-file (no --tokenizer-type given)"
            )
        elif d.mock_data and tok.vocab_size:
            tok.tokenizer_type = "NullTokenizer"
        else:
            raise ConfigError(
                "--tokenizer-type is required (e.g. GPT2BPETokenizer, or NullTokenizer with --mock-data)"
            )
    if tok.tokenizer_type == "NullTokenizer" and not tok.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (e.g. --vocab-size 32000)")


def check_checkpointing(cfg) -> None:
    c = cfg.checkpoint
    if c.save_interval is not None and not c.save:
        raise ConfigError("--save-interval needs --save DIR")
    if cfg.training.exit_signal_handler and not c.save:
        raise ConfigError("--exit-signal-handler saves before exiting and needs --save DIR")
    if cfg.logger.log_progress and not c.save:
        raise ConfigError("--log-progress writes <save>/progress.txt and needs --save DIR")
    if c.save:  # before any training: a first save that cannot be written would end the run
        check_save_dir(c.save)


def check_implementation(cfg) -> None:
    if cfg.impl.transformer_impl == "transformer_engine":
        raise ConfigError(
            "--transformer-impl transformer_engine is not supported by this build; use --transformer-impl local "
            "(the default)"
        )


def check_fp8(cfg) -> None:
    """FP8 needs a CUDA GPU; fail at parse time on a machine without one (a dry run is exempt).

    Only ``torch.cuda.is_available()`` is asked here (it creates no CUDA context); the compute
    capability (Hopper, 9.0+) is checked by ``execution_plan.resolve`` once the rank's device is set.
    """
    m = cfg.model
    if m.first_last_layers_bf16 and m.fp8_format is not None:
        for flag, value in (
            ("--num-layers-at-start-in-bf16", m.num_layers_at_start_in_bf16),
            ("--num-layers-at-end-in-bf16", m.num_layers_at_end_in_bf16),
        ):
            if value < 0:
                raise ConfigError(f"{flag} {value}: give a count of transformer layers from 0 (e.g. 1)")
        if m.num_layers_at_start_in_bf16 + m.num_layers_at_end_in_bf16 >= m.num_layers:
            raise ConfigError(
                f"--first-last-layers-bf16 with --num-layers-at-start-in-bf16 {m.num_layers_at_start_in_bf16} and "
                f"--num-layers-at-end-in-bf16 {m.num_layers_at_end_in_bf16} keeps all {m.num_layers} layers in bf16; "
                f"keep fewer (together at most {m.num_layers - 1}), or drop --fp8-format"
            )
    if m.fp8_format is None or cfg.training.dry_run:
        return
    if not torch.cuda.is_available() and not fp8_emulated(torch.device("cpu")):
        raise ConfigError(
            f"--fp8-format {m.fp8_format} needs an H100/H200-class GPU (Hopper, compute capability "
            "9.0 or newer) and this machine has no CUDA device; drop --fp8-format to train in bf16"
        )


def check_fsdp(cfg) -> None:
    """What FSDP2 (--use-torch-fsdp2, or --use-megatron-fsdp with a strategy sharding gradients)
    cannot compose with yet: one line naming both flags and what to use instead."""
    d = cfg.ddp
    if d.fsdp_sharding() is None:
        return
    flag = "--use-torch-fsdp2" if d.use_torch_fsdp2 else "--use-megatron-fsdp"
    if d.use_torch_fsdp2 and d.use_distributed_optimizer:
        raise ConfigError(
            "--use-distributed-optimizer with --use-torch-fsdp2: FSDP2 already shards the optimizer "
            "state over the data-parallel ranks; drop --use-distributed-optimizer"
        )
    if cfg.model.fp8_format is not None and cfg.model.fp8_recipe == "delayed":
        raise ConfigError(
            f"--fp8-recipe delayed (the default with --fp8-format) with {flag} is not built (delayed "
            "scaling's amax history of dp-sharded weights); use --fp8-recipe tensorwise"
        )
    if cfg.logger.log_params_norm:
        raise ConfigError(
            f"--log-params-norm with {flag} is not built (the norm of dp-sharded parameters); "
            "drop --log-params-norm"
        )


def check_logging(cfg) -> None:
    if cfg.logger.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            raise ConfigError("--wandb-project needs the wandb package: pip install wandb") from e


# Checks that need the world size come first; the rest read the configs only.
def check_lr_schedule(cfg, world_size: int) -> None:
    """The LR/WD schedule's own checks (warm-up shorter than decay, WSD lengths, ...), run on a
    stand-in optimizer so that they fail here, before any model is built."""
    train_iters = train_iters_of(cfg, build_batch_calculator(cfg, data_parallel_size(cfg, world_size)))
    build_scheduler(cfg, SimpleNamespace(param_groups=[{"lr_mult": 1.0, "wd_mult": 1.0}]), train_iters)


LAYOUT_CHECKS = (check_batch_sizes, check_experts, check_training_length, check_pipeline)
CHECKS = (
    check_sequence,
    check_context_parallel,
    check_schedule_units,
    check_optimizer,
    check_data_and_tokenizer,
    check_split,
    check_checkpointing,
    check_implementation,
    check_fp8,
    check_fsdp,
    check_logging,
)
# Last: the schedule is built from values the checks above vouch for (--lr given, units consistent).
FINAL_CHECKS = (check_lr_schedule,)


def validate_run_config(cfg, world_size: int | None = None) -> None:
    ws = planned_world_size(cfg) if world_size is None else world_size
    for layout_check in LAYOUT_CHECKS:
        layout_check(cfg, ws)
    for check in CHECKS:
        check(cfg)
    for final_check in FINAL_CHECKS:
        final_check(cfg, ws)
