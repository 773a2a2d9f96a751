"""Application configs: batch and iterations, schedules, data, tokenizer, checkpoints, logging.

Each field documents itself; ``megatron.training.arguments`` turns every field whose ``flag`` is
not ``None`` into a command-line flag spelled as Megatron-LM spells it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import check_choice, check_positive, doc
from megatron.core.tokenizer import TOKENIZER_TYPES

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class TrainingConfig:
    """Batch sizes, training length, seeds and exit conditions."""

    micro_batch_size: int | None = doc(None, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = doc(
        None, "Samples per optimizer step across all data-parallel ranks; default micro-batch x DP. "
        "Gradient accumulation runs global / (micro x DP) micro-batches."
    )
    seq_length: int | None = doc(None, "Tokens per sample.")
    train_iters: int | None = doc(None, "Optimizer steps to train (exclusive with --train-samples).")
    train_samples: int | None = doc(None, "Samples to train; steps = samples / global batch.")
    seed: int = doc(1234, "Random seed for weights, dropout and data order.")
    exit_interval: int | None = doc(None, "Save (if --save) and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: float | None = doc(
        None, "Save (if --save) and exit after this many minutes of training (checked after every step; the "
              "step already queued behind it finishes first).")
    exit_signal_handler: bool = doc(
        False, "On SIGTERM, finish the running step (and the one queued behind it), save a checkpoint and exit 0.")
    check_for_nan_in_loss_and_grad: bool = doc(
        True, "Stop (exit code 3, nothing saved) when the gradient norm is NaN or Inf; "
        "--no-check-for-nan-in-loss-and-grad keeps going. fp16 overflow steps are skipped instead.")
    make_vocab_size_divisible_by: int = doc(128, "Pad the vocabulary to a multiple of this times the TP size.")
    max_position_embeddings: int | None = doc(None, "Positions in the learned position table; >= --seq-length.")
    distributed_backend: str = doc("auto", "torch.distributed backend; auto = nccl with CUDA, else gloo.",
                                   choices=("auto", "nccl", "gloo"))
    distributed_timeout_minutes: int = doc(10, "Timeout of collectives in minutes.")
    dry_run: bool = doc(False, "Validate the configuration, build the model on the meta device, print the "
                               "parameter count and estimated memory, and exit before any training.")

    def __post_init__(self) -> None:
        check_positive("micro_batch_size", self.micro_batch_size)
        check_positive("global_batch_size", self.global_batch_size, allow_none=True)
        check_positive("seq_length", self.seq_length)
        if (self.train_iters is None) == (self.train_samples is None):
            raise ValueError("give exactly one of --train-iters or --train-samples (e.g. --train-iters 1000)")
        check_positive("train_iters", self.train_iters, allow_none=True, allow_zero=True)
        check_positive("train_samples", self.train_samples, allow_none=True, allow_zero=True)
        check_positive("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length


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
    lr_wsd_decay_style: str = doc("exponential", "Annealing shape of the WSD schedule.", choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = doc(None, "Annealing length of WSD in iterations.")
    lr_wsd_decay_samples: int | None = doc(None, "Annealing length of WSD in samples.")
    start_weight_decay: float | None = doc(None, "Weight decay at step 0; default --weight-decay.")
    end_weight_decay: float | None = doc(None, "Weight decay at the end; default --weight-decay.")
    weight_decay_incr_style: str = doc("constant", "Weight-decay schedule from start to end.", choices=WD_INCR_STYLES)
    override_opt_param_scheduler: bool = doc(False, "Ignore the scheduler state in the checkpoint; use the flags.")
    use_checkpoint_opt_param_scheduler: bool = doc(False, "Take the schedule from the checkpoint, not the flags.")

    def __post_init__(self) -> None:
        check_choice("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ValueError("--lr-warmup-fraction cannot be combined with --lr-warmup-iters/--lr-warmup-samples")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
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
    data_cache_path: str | None = doc(None, "Directory for cached dataset indices.")
    mock_data: bool = doc(False, "Synthetic data (no files); needs a tokenizer with a vocabulary size.")
    mmap_bin_files: bool = doc(True, "Memory-map .bin files; --no-mmap-bin-files reads them with plain I/O.")
    num_workers: int = doc(2, "Data-loader worker processes.")
    reset_position_ids: bool = doc(False, "Restart position ids after every end-of-document token.")
    reset_attention_mask: bool = doc(False, "Block-diagonal attention mask per document.")
    eod_mask_loss: bool = doc(False, "Do not compute loss on end-of-document tokens.")
    mid_level_dataset_surplus: float = doc(0.005, "Extra samples requested from each blended dataset.")
    dataloader_type: str = doc("single", "single: sequential from the consumed sample; cyclic: endless.",
                               choices=("single", "cyclic"))

    def __post_init__(self) -> None:
        given = [n for n in ("mock_data", "data_path", "train_data_path") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"give only one data source, got {', '.join('--' + g.replace('_', '-') for g in given)}")
        check_positive("num_workers", self.num_workers, allow_zero=True)


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into ids (files are local; nothing is downloaded)."""

    tokenizer_type: str | None = doc(None, "Tokenizer; NullTokenizer for --mock-data.", choices=TOKENIZER_TYPES)
    vocab_file: str | None = doc(None, "GPT-2 BPE vocab.json (GPT2BPETokenizer).")
    merge_file: str | None = doc(None, "GPT-2 BPE merges.txt (GPT2BPETokenizer).")
    tokenizer_model: str | None = doc(None, "SentencePiece .model, TikToken ranks file, or HF tokenizer dir/json.")
    vocab_size: int | None = doc(None, "Vocabulary size of NullTokenizer (and TikTokenizer's cap).")
    null_tokenizer_eod_id: int | None = doc(None, "End-of-document id of NullTokenizer; default vocab_size - 1.")
    tiktoken_pattern: str = doc("v2", "TikTokenizer split pattern.", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = doc(1000, "Ids reserved for special tokens by TikTokenizer.")
    padded_vocab_size: int | None = doc(None, "Use this padded vocabulary size instead of computing it.")


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
    ckpt_format: str = doc("torch_dist", "Checkpoint format.", choices=("torch_dist",))

    def __post_init__(self) -> None:
        check_positive("save_interval", self.save_interval, allow_none=True)


@dataclass
class LoggerConfig:
    """What is logged, how often, and where."""

    log_interval: int = doc(100, "Print the training log line every this many iterations.")
    eval_interval: int | None = doc(None, "Evaluate on the validation set every this many iterations.")
    eval_iters: int = doc(100, "Validation batches per evaluation; 0 turns evaluation off.")
    log_throughput: bool = doc(False, "Accepted for compatibility; throughput is always logged.")
    tensorboard_dir: str | None = doc(None, "Write TensorBoard scalars here.")
    wandb_project: str | None = doc(None, "Weights & Biases project (WANDB_MODE=offline works without network).")
    wandb_exp_name: str | None = doc(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = doc(None, "Weights & Biases local directory.")
    metrics_file: str | None = doc(
        None, "JSON-lines metrics file; default metrics.jsonl in --tensorboard-dir, else --save, else none."
    )
    profile: bool = doc(False, "Profile iterations --profile-step-start to --profile-step-end - 1 on --profile-ranks: "
                               "with --use-pytorch-profiler a torch.profiler trace and a kernel-time summary, "
                               "otherwise cudaProfilerStart/Stop around them for nsys --capture-range=cudaProfilerApi.")
    use_pytorch_profiler: bool = doc(False, "Use torch.profiler for --profile.")
    profile_step_start: int = doc(10, "First profiled iteration (1-based, as in the log line).")
    profile_step_end: int = doc(12, "Profiling stops before this iteration.")
    profile_ranks: list[int] = doc(default_factory=lambda: [0], help="Global ranks that profile.", nargs="+")
    profile_dir: str | None = doc(None, "Where --use-pytorch-profiler writes its Chrome trace and kernel summary; "
                                        "default --tensorboard-dir, else --save, else ./profile.")

    def __post_init__(self) -> None:
        check_positive("log_interval", self.log_interval)
        check_positive("eval_interval", self.eval_interval, allow_none=True)
        check_positive("eval_iters", self.eval_iters, allow_zero=True)
        check_positive("profile_step_start", self.profile_step_start)
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"--profile-step-end ({self.profile_step_end}) must be greater than --profile-step-start "
                             f"({self.profile_step_start}), e.g. --profile-step-end {self.profile_step_start + 2}")
