"""The logging section of the run's configuration (``RunConfig.logger``): what is logged, how often,
and where; re-exported by megatron.training.config with the other sections."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import ConfigError, check_positive, doc


@dataclass
class LoggerConfig:
    """What is logged, how often, and where."""

    log_interval: int = doc(100, "Print the training log line every this many iterations.")
    eval_interval: int | None = doc(None, "Evaluate on the validation set every this many iterations.")
    eval_iters: int = doc(100, "Validation batches per evaluation; 0 turns evaluation off.")
    start_eval_at_iter: int | None = doc(
        None,
        "Evaluate during training only at iterations from this one on (--eval-interval still picks them); "
        "default: from the first.",
    )
    log_throughput: bool = doc(False, "Accepted for compatibility; throughput is always logged.")
    tensorboard_dir: str | None = doc(None, "Write TensorBoard scalars here.")
    wandb_project: str | None = doc(
        None, "Weights & Biases project (WANDB_MODE=offline works without network)."
    )
    wandb_exp_name: str | None = doc(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = doc(None, "Weights & Biases local directory.")
    wandb_entity: str | None = doc(
        None,
        "Weights & Biases team or user the run belongs to (wandb.init's entity); "
        "default: the account's default entity.",
    )
    log_loss_scale_to_tensorboard: bool = doc(
        True,
        "Write the loss scale with the other scalars (TensorBoard, W&B, the metrics file); "
        "--no-log-loss-scale-to-tensorboard leaves it out (the log line always shows it).",
    )
    log_params_norm: bool = doc(
        False,
        "Compute the L2 norm of all parameters at every log line (one all-reduce over the model-parallel "
        "ranks) and show it as 'params norm' beside the gradient norm, and in the scalars.",
    )
    log_progress: bool = doc(
        False,
        "Append one line to <save>/progress.txt at start-up and after every checkpoint: iteration, "
        "consumed samples, tokens and floating-point operations so far, and the job's throughput.",
    )
    log_batch_fingerprint: bool = doc(
        False,
        "Print a hash of each training step's global batch of tokens, so that a resumed run can be seen to "
        "read the batches the uninterrupted run read (the resume block prints the first one after the load).",
    )
    log_world_size_to_tensorboard: bool = doc(
        False, "Also write the world size (number of processes) with the scalars of every logged iteration."
    )
    metrics_file: str | None = doc(
        None, "JSON-lines metrics file; default metrics.jsonl in --tensorboard-dir, else --save, else none."
    )
    log_straggler: bool = doc(
        False, "Every --log-interval, print on rank 0 the ranks with the longest busy time per iteration."
    )
    timing_log_level: int = doc(
        0,
        "Print the per-step time breakdown every --log-interval: 1 the phases (forward-backward, "
        "batch-generator, all-grads-sync, pipeline-wait, optimizer, params-all-gather), 2 also "
        "forward-compute and the pipeline's recv/send waits. 1 and 2 synchronise the device at each "
        "timer boundary (slower steps); 0 adds nothing.",
        choices=(0, 1, 2),
        metavar="{0,1,2}",
    )
    timing_log_option: str = doc(
        "minmax",
        "How --timing-log-level shows each timer over the ranks: max, minmax (the fastest and slowest "
        "rank) or all (every rank).",
        choices=("max", "minmax", "all"),
    )
    log_timers_to_tensorboard: bool = doc(
        False,
        "Also write each timer (<name>-time, the slowest rank's seconds per step) with the scalars "
        "(TensorBoard, W&B, the metrics file).",
    )
    profile: bool = doc(
        False,
        "Profile iterations --profile-step-start to --profile-step-end - 1 on --profile-ranks: "
        "with --use-pytorch-profiler a torch.profiler trace and a kernel-time summary, "
        "otherwise cudaProfilerStart/Stop around them for nsys --capture-range=cudaProfilerApi.",
    )
    use_pytorch_profiler: bool = doc(False, "Use torch.profiler for --profile.")
    profile_step_start: int = doc(10, "First profiled iteration (1-based, as in the log line).")
    profile_step_end: int = doc(12, "Profiling stops before this iteration.")
    profile_ranks: list[int] = doc(default_factory=lambda: [0], help="Global ranks that profile.", nargs="+")
    pytorch_profiler_collect_shapes: bool = doc(
        False, "--use-pytorch-profiler: record each operator's input shapes in the trace (larger trace)."
    )
    pytorch_profiler_collect_callstack: bool = doc(
        False, "--use-pytorch-profiler: record the Python call stack of each operator in the trace (slower)."
    )
    profile_dir: str | None = doc(
        None,
        "Where --use-pytorch-profiler writes its Chrome trace and kernel summary; "
        "default --tensorboard-dir, else --save, else ./profile.",
    )

    def __post_init__(self) -> None:
        check_positive("log_interval", self.log_interval)
        check_positive("eval_interval", self.eval_interval, allow_none=True)
        check_positive("eval_iters", self.eval_iters, allow_zero=True)
        check_positive("profile_step_start", self.profile_step_start)
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end ({self.profile_step_end}) must be greater than --profile-step-start "
                f"({self.profile_step_start}), e.g. --profile-step-end {self.profile_step_start + 2}"
            )
