"""Application configs: batch and iterations, schedules, data, tokenizer, checkpoints, logging.

Each field documents itself; ``megatron.training.arguments`` turns every field whose ``flag`` is
not ``None`` into a command-line flag spelled as Megatron-LM spells it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megatron.core.config_utils import ConfigError, check_choice, check_positive, doc
from megatron.core.num_microbatches_calculator import parse_step_batch_size_schedule
from megatron.core.tokenizer import TOKENIZER_TYPES
from megatron.training.config_logger import LoggerConfig as LoggerConfig

EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGXCPU")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class TrainingConfig:
    """Batch sizes, training length, seeds and exit conditions."""

    micro_batch_size: int | None = doc(None, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = doc(
        None,
        "Samples per optimizer step across all data-parallel ranks; default micro-batch x DP. "
        "Gradient accumulation runs global / (micro x DP) micro-batches.",
    )
    seq_length: int | None = doc(None, "Tokens per sample.")
    train_iters: int | None = doc(None, "Optimizer steps to train (exclusive with --train-samples).")
    train_samples: int | None = doc(
        None,
        "Samples to train; steps = samples / global batch (with a batch-size "
        "ramp, its steps counted one by one; a last partial batch is dropped).",
    )
    rampup_batch_size: list[int] | None = doc(
        None,
        "Batch-size ramp-up <start> <increment> <ramp-up samples>: the global batch size starts at <start> "
        "and grows by <increment> in (global - start) / increment equal intervals of consumed samples, reaching "
        "--global-batch-size after <ramp-up samples> samples. Every batch size used must be a multiple of "
        "--micro-batch-size x data-parallel size. With --train-iters (as in Megatron-LM's gpt3 example) the run "
        "takes that many steps and the LR schedule's iteration lengths are converted to samples at the final "
        "batch size; --train-samples counts the ramp's steps exactly.",
        nargs="*",
    )
    step_batch_size_schedule: str | None = doc(
        None,
        'Step-wise global batch size, e.g. "0:16 2.4B:320 4.8B:624": THRESHOLD:BATCH entries (K/M/B/T '
        "suffixes = 1e3/1e6/1e9/1e12); the batch of the last threshold reached applies, thresholds counting "
        "consumed tokens (samples x --seq-length). The first threshold is 0; the last batch is the final global "
        "batch size (--global-batch-size may be omitted, or must equal it). With --train-iters, iteration "
        "lengths of the LR schedule are converted to samples at the final batch size, as in Megatron.",
    )
    skip_train: bool = doc(
        False,
        "Build everything and load --load, train nothing: evaluate the validation and "
        "test sets at the loaded iteration, save nothing.",
    )
    seed: int = doc(1234, "Random seed for weights, dropout and data order.")
    exit_interval: int | None = doc(
        None, "Save (if --save) and exit when the iteration is a multiple of this."
    )
    exit_duration_in_mins: float | None = doc(
        None,
        "Save (if --save) and exit after this many minutes of training (checked after every step; the "
        "step already queued behind it finishes first).",
    )
    exit_signal_handler: bool = doc(
        False,
        "On SIGTERM (or the --exit-signal) or Ctrl-C (SIGINT), finish the running step (and the one queued "
        "behind it), save a checkpoint and exit 0; a second Ctrl-C aborts. DataLoader workers ignore these signals, "
        "so a signal sent to the whole process group (torchrun, Slurm) stops the run the same way.",
    )
    exit_signal: str = doc(
        "SIGTERM",
        "The signal --exit-signal-handler saves and exits on, besides SIGINT "
        "(e.g. SIGUSR1 for Slurm's --signal=USR1@120).",
        choices=EXIT_SIGNALS,
    )
    check_for_nan_in_loss_and_grad: bool = doc(
        True,
        "Reject a step whose loss or gradient is NaN/Inf before the update (decided on the device, "
        "no host sync), name the rank and the first parameter, then act per --rerun-mode; "
        "--no-check-for-nan-in-loss-and-grad trains on. fp16 overflow steps are skipped as before.",
    )
    check_for_spiky_loss: bool = doc(
        False,
        "Reject a step whose loss is more than 10x the median of the last 10 accepted steps' losses "
        "(after 5 of them), then act per --rerun-mode (disabled: warn only).",
    )
    rerun_mode: str = doc(
        "validate_results",
        "What a rejected step leads to. validate_results: re-run it in place with the same data and "
        "random state; not reproduced (transient fault) the re-run's update is kept, reproduced the batch "
        "is skipped (two such steps in a row stop the run, exit 3). report_stats: re-run every step and "
        "report how much loss and gradient norm differ. disabled: no re-run; a NaN stops the run (exit 3).",
        choices=("validate_results", "report_stats", "disabled"),
    )
    result_rejected_tracker_filename: str | None = doc(
        None, "Append one line per rejected result (Megatron's format) to this file."
    )
    error_injection_rate: int = doc(
        0,
        "Fault drills: inject a fault about once every this many steps on each rank (0: never; "
        "deterministic for a --seed). See --error-injection-iterations for chosen steps.",
    )
    error_injection_type: str = doc(
        "transient_error",
        "transient_error: the fault is in the first run only (a re-run does not reproduce it); "
        "persistent_error / correct_result: also in the re-run (here both are reproduced in place).",
        choices=("correct_result", "transient_error", "persistent_error"),
    )
    error_injection_iterations: list[int] = doc(
        default_factory=list, help="Inject the fault at exactly these iterations (drills, tests).", nargs="*"
    )
    error_injection_ranks: list[int] | None = doc(
        None, "The ranks a fault is injected on (default: every rank).", nargs="*"
    )
    error_injection_kind: str = doc(
        "nan_grad",
        "What is injected: nan_grad (this rank's gradients become NaN; the loss stays finite) or "
        "spiky_loss (the last stage's loss, and its gradients, scaled by 1000).",
        choices=("nan_grad", "spiky_loss"),
    )
    iterations_to_skip: list[int] = doc(
        default_factory=list,
        help="Iterations that consume their batch without updating the model (counted as skipped).",
        nargs="*",
    )
    make_vocab_size_divisible_by: int = doc(
        128, "Pad the vocabulary to a multiple of this times the TP size."
    )
    max_position_embeddings: int | None = doc(
        None, "Positions in the learned position table; >= --seq-length."
    )
    distributed_backend: str = doc(
        "auto",
        "torch.distributed backend; auto = nccl with CUDA, else gloo.",
        choices=("auto", "nccl", "gloo"),
    )
    distributed_timeout_minutes: int = doc(
        10, "Timeout of collectives in minutes; after the first iteration see the seconds flag below."
    )
    distributed_timeout_seconds_after_init: int | None = doc(
        None, "Timeout of collectives in seconds after the first iteration (default: the minutes flag)."
    )
    flight_recorder_dump_on_timeout: bool = doc(
        True, "On a hang or a lost rank, print and save the hang report (stacks, collectives); off: one line."
    )
    dry_run: bool = doc(
        False,
        "Validate the configuration, build the model on the meta device, print the "
        "parameter count and estimated memory, and exit before any training.",
    )
    world_size: int | None = doc(
        None,
        "Processes the run is planned for: with --dry-run, the world size to validate the layout and "
        "estimate memory for (tensor x pipeline x data parallel). Default: the launcher's (WORLD_SIZE from torchrun, "
        "SLURM_NTASKS from srun), else 1. A real run takes it from the launcher; if given, it must agree.",
    )

    def __post_init__(self) -> None:
        check_positive("micro_batch_size", self.micro_batch_size)
        check_positive("global_batch_size", self.global_batch_size, allow_none=True)
        check_positive("seq_length", self.seq_length)
        if (self.train_iters is None) == (self.train_samples is None):
            raise ConfigError(
                "give exactly one of --train-iters or --train-samples (e.g. --train-iters 1000)"
            )
        check_positive("train_iters", self.train_iters, allow_none=True, allow_zero=True)
        check_positive("train_samples", self.train_samples, allow_none=True, allow_zero=True)
        check_positive("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        check_positive("world_size", self.world_size, allow_none=True)
        if self.distributed_timeout_minutes < 1:  # an int of minutes, as in Megatron-LM
            raise ConfigError(
                f"--distributed-timeout-minutes must be a whole number of minutes >= 1, got "
                f"{self.distributed_timeout_minutes} (e.g. --distributed-timeout-minutes 10, the default)"
            )
        check_positive("error_injection_rate", self.error_injection_rate, allow_zero=True)
        after_init = self.distributed_timeout_seconds_after_init
        check_positive("distributed_timeout_seconds_after_init", after_init, allow_none=True)
        self._check_batch_schedule()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    def _check_batch_schedule(self) -> None:
        """The ramp flags' own rules; the divisibility by micro-batch x data-parallel size is checked
        with the world size (validation.check_batch_sizes)."""
        ramp, steps = self.rampup_batch_size, self.step_batch_size_schedule
        if ramp is not None and steps is not None:
            raise ConfigError("--rampup-batch-size and --step-batch-size-schedule are exclusive; give one")
        if ramp is not None:
            if len(ramp) != 3:
                raise ConfigError(
                    f"--rampup-batch-size takes 3 values <start> <increment> <ramp-up samples>, got "
                    f"{len(ramp)} (e.g. --rampup-batch-size 16 16 5859375)"
                )
        if steps is not None:
            final = parse_step_batch_size_schedule(steps, self.seq_length)[-1][1]
            if self.global_batch_size is not None and self.global_batch_size != final:
                raise ConfigError(
                    f"--global-batch-size {self.global_batch_size} differs from the last batch size of "
                    f"--step-batch-size-schedule ({final}); drop --global-batch-size or set it to {final}"
                )
            self.global_batch_size = final


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedules. Steps are counted in samples, as in Megatron."""

    lr_decay_style: str = doc("linear", "Learning-rate decay after warm-up.", choices=LR_DECAY_STYLES)
    lr_warmup_iters: int = doc(0, "Linear warm-up length in iterations.")
    lr_warmup_samples: int = doc(0, "Linear warm-up length in samples (with --train-samples).")
    lr_warmup_fraction: float | None = doc(None, "Warm-up as a fraction of the decay length.")
    lr_warmup_init: float = doc(0.0, "Learning rate at the start of warm-up.")
    lr_decay_iters: int | None = doc(None, "Decay length in iterations; default: the training length.")
    lr_decay_samples: int | None = doc(None, "Decay length in samples; default: the training length.")
    lr_wsd_decay_style: str = doc(
        "exponential", "Annealing shape of the WSD schedule.", choices=WSD_DECAY_STYLES
    )
    lr_wsd_decay_iters: int | None = doc(None, "Annealing length of WSD in iterations.")
    lr_wsd_decay_samples: int | None = doc(None, "Annealing length of WSD in samples.")
    start_weight_decay: float | None = doc(None, "Weight decay at step 0; default --weight-decay.")
    end_weight_decay: float | None = doc(None, "Weight decay at the end; default --weight-decay.")
    weight_decay_incr_style: str = doc(
        "constant", "Weight-decay schedule from start to end.", choices=WD_INCR_STYLES
    )
    override_opt_param_scheduler: bool = doc(
        False, "Ignore the scheduler state in the checkpoint; use the flags."
    )
    use_checkpoint_opt_param_scheduler: bool = doc(
        False, "Take the schedule from the checkpoint, not the flags."
    )

    def __post_init__(self) -> None:
        check_choice("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ConfigError(
                "--lr-warmup-fraction cannot be combined with --lr-warmup-iters/--lr-warmup-samples"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive; give one"
            )


@dataclass
class DataConfig:
    """Where samples come from and how they are cut and masked."""

    data_path: list[str] | None = doc(
        None, "Data prefixes, optionally weighted: 'prefix' or 'w1 prefix1 w2 prefix2 ...'.", nargs="*"
    )
    split: str | None = doc(None, "Train/valid/test proportions of --data-path, e.g. '969,30,1'.")
    train_data_path: list[str] | None = doc(None, "Blend for the train split only.", nargs="*")
    valid_data_path: list[str] | None = doc(None, "Blend for the validation split only.", nargs="*")
    test_data_path: list[str] | None = doc(None, "Blend for the test split only.", nargs="*")
    data_args_path: str | None = doc(
        None,
        "A text file holding the --data-path value (prefixes, optionally weighted, separated by white "
        "space), for blends too long for a command line.",
    )
    per_split_data_args_path: str | None = doc(
        None,
        "A JSON file with keys 'train', 'valid' and 'test', each the value of --train-data-path, "
        "--valid-data-path, --test-data-path (a string or a list), for blends too long for a command line.",
    )
    data_cache_path: str | None = doc(None, "Directory for cached dataset indices.")
    mock_data: bool = doc(False, "Synthetic data (no files); needs a tokenizer with a vocabulary size.")
    mmap_bin_files: bool = doc(True, "Memory-map .bin files; --no-mmap-bin-files reads them with plain I/O.")
    num_workers: int = doc(2, "Data-loader worker processes.")
    reset_position_ids: bool = doc(False, "Restart position ids after every end-of-document token.")
    reset_attention_mask: bool = doc(
        False,
        "Packed documents do not attend to each other: block-diagonal causal attention per document, found "
        "from the end-of-document tokens (variable-length flash attention on the GPU, never a dense "
        "[s, s] mask; per block under --context-parallel-size). With --reset-position-ids and "
        "--eod-mask-loss each document trains as its own sequence.",
    )
    eod_mask_loss: bool = doc(False, "Do not compute loss on end-of-document tokens.")
    create_attention_mask_in_dataloader: bool = doc(
        True,
        "Accepted for Megatron-LM scripts, with no effect: no per-sample [s, s] mask is built either way. "
        "With --reset-attention-mask the model reads the documents from the tokens; without it attention "
        "is plain causal.",
    )
    mid_level_dataset_surplus: float = doc(0.005, "Extra samples requested from each blended dataset.")
    dataloader_type: str = doc(
        "single",
        "single: sequential from the consumed sample; cyclic: endless.",
        choices=("single", "cyclic"),
    )

    def __post_init__(self) -> None:
        self._read_data_args()
        given = [n for n in ("mock_data", "data_path", "train_data_path") if getattr(self, n)]
        if len(given) > 1:
            raise ConfigError(
                f"give only one data source, got {', '.join('--' + g.replace('_', '-') for g in given)}"
            )
        check_positive("num_workers", self.num_workers, allow_zero=True)

    def _read_data_args(self) -> None:
        """Fill the blends from --data-args-path / --per-split-data-args-path (Megatron-LM's files)."""
        if self.data_args_path is not None:
            if self.data_path:
                raise ConfigError("give --data-path or --data-args-path, not both")
            self.data_path = _read_text(self.data_args_path, "--data-args-path").split()
        if self.per_split_data_args_path is not None:
            if self.train_data_path or self.valid_data_path or self.test_data_path:
                raise ConfigError("give --train/valid/test-data-path or --per-split-data-args-path, not both")
            flag = "--per-split-data-args-path"
            try:
                splits = json.loads(_read_text(self.per_split_data_args_path, flag))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} {self.per_split_data_args_path}: not JSON ({e})") from None
            if not isinstance(splits, dict) or "train" not in splits:
                raise ConfigError(
                    f"{flag} {self.per_split_data_args_path}: give an object with a 'train' key "
                    '(and \'valid\', \'test\'), e.g. {"train": "0.7 a 0.3 b", "valid": "c"}'
                )
            for name in ("train", "valid", "test"):
                value = splits.get(name)
                words = (
                    value.split() if isinstance(value, str) else ([str(v) for v in value] if value else None)
                )
                setattr(self, f"{name}_data_path", words)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into ids (files are local; nothing is downloaded)."""

    tokenizer_type: str | None = doc(
        None, "Tokenizer; NullTokenizer for --mock-data.", choices=TOKENIZER_TYPES
    )
    vocab_file: str | None = doc(None, "GPT-2 BPE vocab.json (GPT2BPETokenizer).")
    merge_file: str | None = doc(None, "GPT-2 BPE merges.txt (GPT2BPETokenizer).")
    tokenizer_model: str | None = doc(
        None, "SentencePiece .model, TikToken ranks file, or HF tokenizer dir/json."
    )
    vocab_size: int | None = doc(None, "Vocabulary size of NullTokenizer (and TikTokenizer's cap).")
    null_tokenizer_eod_id: int | None = doc(
        None, "End-of-document id of NullTokenizer; default vocab_size - 1."
    )
    tiktoken_pattern: str = doc("v2", "TikTokenizer split pattern.", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = doc(1000, "Ids reserved for special tokens by TikTokenizer.")
    padded_vocab_size: int | None = doc(None, "Use this padded vocabulary size instead of computing it.")
    pad_vocab_size: bool = doc(
        True,
        "Pad the vocabulary to a multiple of --make-vocab-size-divisible-by x the tensor-parallel size; "
        "--no-pad-vocab-size keeps the tokenizer's size (which the tensor-parallel size must then divide).",
    )


@dataclass
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = doc(None, "Directory to save checkpoints to.")
    load: str | None = doc(None, "Directory to load the latest checkpoint from.")
    save_interval: int | None = doc(None, "Save every this many iterations.")
    save_optim: bool = doc(True, "Save optimizer state; --no-save-optim skips it.")
    save_rng: bool = doc(True, "Save RNG state; --no-save-rng skips it.")
    load_optim: bool = doc(True, "Load optimizer state; --no-load-optim skips it.")
    load_rng: bool = doc(True, "Load RNG state; --no-load-rng skips it.")
    finetune: bool = doc(False, "Load model weights only and start from iteration 0.")
    exit_on_missing_checkpoint: bool = doc(False, "Exit with an error when --load holds no checkpoint.")
    ckpt_step: int | None = doc(None, "Load this iteration instead of the latest.")
    async_save: bool = doc(
        False,
        "Write checkpoints in the background: the save copies the state to pinned host memory and training "
        "continues while the files are written; the tracker names the checkpoint only once every rank has "
        "finished, and the next save (or the end of training) waits for the previous one.",
    )
    ckpt_keep_last: int | None = doc(
        None,
        "Keep only the newest N checkpoints of --save: an older one is deleted once a newer one is complete. "
        "Default: keep all.",
    )
    save_retain_interval: int | None = doc(
        None,
        "Megatron's retention: after each save, delete the previous checkpoint unless its iteration is a "
        "multiple of this. Default: keep all.",
    )
    use_checkpoint_args: bool = doc(
        False,
        "Take the model's architecture flags (layers, sizes, heads, norms, activation, positions, tokenizer) "
        "from the --load checkpoint before building the model; flags given on the command line win.",
    )
    ckpt_format: str = doc(
        "torch_dist",
        "Checkpoint format. torch_dist: Megatron's distributed format, saved and loaded under any "
        "layout. torch: Megatron-LM's legacy per-rank files (mp_rank_XX[_YYY]/model_optim_rng.pt), read only: "
        "weights (under any layout), iteration, consumed samples and LR schedule; the optimizer state is not read "
        "(it restarts from the weights, as with --no-load-optim) nor are RNG states; saves are always torch_dist, so "
        "torch with --save is refused. Either way the format of --load is detected from its files. "
        "fsdp_dtensor (Megatron-FSDP's name): the torch_dist layout, which FSDP2 runs save and load too.",
        choices=("torch_dist", "torch", "fsdp_dtensor"),
    )

    def __post_init__(self) -> None:
        check_positive("save_interval", self.save_interval, allow_none=True)
        check_positive("ckpt_keep_last", self.ckpt_keep_last, allow_none=True)
        check_positive("save_retain_interval", self.save_retain_interval, allow_none=True)
        if self.ckpt_keep_last is not None and not self.save:
            raise ConfigError(
                f"--ckpt-keep-last {self.ckpt_keep_last} needs --save (it deletes older checkpoints of --save); "
                "pass --save DIR or drop --ckpt-keep-last"
            )
        if self.ckpt_format == "torch" and self.save:
            raise ConfigError(
                "--ckpt-format torch with --save: saves are written as torch_dist only; drop "
                "--ckpt-format torch (a legacy --load directory is detected from its files)"
            )
