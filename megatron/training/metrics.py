"""Where training numbers go: the stdout log line (Megatron's format), TensorBoard, W&B and JSONL.

Only the rank that owns the loss (the last rank) writes; other ranks get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import statistics
import time
from collections import deque
from datetime import datetime

import torch.distributed as dist

from megatron.training.moe_metrics import LINE_METRICS, format_moe_metrics
from megatron.training.timers import TIMER_LEVELS

# The record's fixed keys shown on the line, in Megatron's order: (key, label, format). The losses and
# MoE values follow the batch size; a key the record lacks is not shown.
_HEAD = (
    ("consumed-samples", "consumed samples", "{:12d}"),
    ("iteration-time", "elapsed time per iteration (ms)", "ms"),
    ("throughput", "throughput per GPU (TFLOP/s/GPU)", "tflops"),
    ("tokens-per-sec-per-gpu", "tokens per second per GPU", "{:.1f}"),
    ("mfu", "MFU", "percent"),
    ("learning-rate", "learning rate", "{:.6E}"),
    ("decoupled-learning-rate", "decoupled learning rate", "{:.6E}"),  # --decoupled-lr
    ("batch-size", "global batch size", "{:5d}"),
)
_TAIL = (
    ("loss-scale", "loss scale", "{:.1f}"),
    ("grad-norm", "grad norm", "{:.3f}"),
    ("num-zeros", "num zeros", "{:.1f}"),
    ("params-norm", "params norm", "{:.3f}"),
    ("skipped-iterations", "number of skipped iterations", "{:3d}"),
    ("nan-iterations", "number of nan iterations", "{:3d}"),
    # Not in Megatron's line (appended, so that parsers of its fields keep working):
    ("consumed-tokens", "consumed tokens", "{:d}"),
    ("mem-allocated-bytes", "mem allocated (MB)", "MB"),
    ("mem-max-allocated-bytes", "mem max allocated (MB)", "MB"),
    ("mem-max-reserved-bytes", "mem max reserved (MB)", "MB"),
    ("mem-host-max-rss-bytes", "host mem max RSS (MB)", "MB"),
    ("world-size", "world size", "{:d}"),
)
FIXED_KEYS = frozenset(k for k, _, _ in _HEAD + _TAIL)
MOE_STATS = ("expert_load_imbalance", "expert_load_imbalance_max", "dropped_token_fraction")
_NOT_LOSSES = frozenset([*(name for name, _ in LINE_METRICS), *MOE_STATS])
_MOE_LABEL_KEYS = {
    "expert load max/mean": "expert_load_imbalance",
    "dropped tokens": "dropped_token_fraction",
}
TIMER_KEYS = frozenset(f"{name}-time" for name in TIMER_LEVELS)


def _text(value: float, fmt: str) -> str:
    if fmt == "ms":
        return f"{value * 1000.0:.1f}"
    if fmt == "tflops":
        return _tflops(value)
    if fmt == "percent":
        return f"{value * 100:.1f}%"
    if fmt == "MB":
        return f"{value / 2**20:.1f}"
    return fmt.format(value)


def line_fields(record: dict) -> list[tuple[str, str, str]]:
    """(key, label, printed value) of each field of the log line of ``record``, in the line's order.
    The line shows every value of the record but the per-layer MoE ones (``moe/...``) and the timers'
    (``<timer>-time``: the timer block shows them); ``expert_load_imbalance_max`` is shown with
    ``expert_load_imbalance``."""
    out = []
    for key, label, fmt in _HEAD:
        if key in record:
            out.append((key, label, _text(record[key], fmt)))
        elif key == "mfu":  # no dense bf16 peak on record for the device
            out.append((key, label, "n/a"))
    out += [(k, k, f"{record[k]:.6E}") for k in loss_keys(record)]
    for part in format_moe_metrics(record):
        label, text = part.split(": ", 1)
        out.append((_MOE_LABEL_KEYS.get(label, label), label, text))
    out += [(key, label, _text(record[key], fmt)) for key, label, fmt in _TAIL if key in record]
    return out


def loss_keys(record: dict) -> list[str]:
    """The keys of ``record`` that are training losses (``lm loss`` and the model's other ones)."""
    return [
        k
        for k in record
        if k not in FIXED_KEYS and k not in _NOT_LOSSES and not k.startswith("moe/") and k not in TIMER_KEYS
    ]


def format_iteration_line(it: int, train_iters: int, record: dict) -> str:
    """One training log line: Megatron's fields in Megatron's order, plus tokens/s and MFU after the
    throughput, then ours (tokens, memory) at the end; ``record`` as ``IntervalLog`` builds it."""
    parts = [f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {it:8d}/{train_iters:8d}"]
    parts += [f"{label}: {text}" for _, label, text in line_fields(record)]
    return " | ".join(parts) + " |"


class LossSpikeWatch:
    """Says in one line when a logged loss jumps far above its recent level; the run goes on.

    A logged value is a spike when, with at least ``WARMUP`` earlier values of the same name on record,
    it exceeds ``FACTOR`` times the median of the last ``WINDOW`` of them and that median by more than
    ``MARGIN`` (nats). The median ignores an earlier spike; the margin keeps small losses quiet (a
    memorised batch near 0, an auxiliary loss). Non-finite values are counted as nan iterations by the
    log line and are not recorded; every finite one is, so a lasting change of level stops warning
    after a few lines."""

    FACTOR = 3.0
    WINDOW = 10
    WARMUP = 3
    MARGIN = 1.0

    def __init__(self) -> None:
        self.history: dict[str, deque[float]] = {}

    def check(self, first: int, last: int, losses: dict[str, float]) -> list[str]:
        """Warnings for the losses averaged over iterations ``first``..``last`` (one log line)."""
        lines = []
        for name, value in losses.items():
            if not math.isfinite(value):
                continue
            past = self.history.setdefault(name, deque(maxlen=self.WINDOW))
            if len(past) >= self.WARMUP:
                level = statistics.median(past)
                if value > self.FACTOR * level and value - level > self.MARGIN:
                    steps = f"iteration {last}" if first == last else f"iterations {first}-{last}"
                    lines.append(
                        f"warning: loss spike: {name} {value:.6E} over {steps} is {value / max(level, 1e-12):.1f}x "
                        f"the median {level:.6E} of the last {len(past)} logged values; the run continues (check "
                        "the data of those steps; a lower --lr or a --clip-grad helps against spikes)"
                    )
            past.append(value)
        return lines


def _tflops(value: float) -> str:
    """Megatron's one decimal, or three significant digits below 1 TFLOP/s (a CPU or a tiny model),
    so that a slow run shows its figure instead of 0.0."""
    return f"{value:.1f}" if value >= 1.0 else f"{value:.3g}"


def format_validation(prefix: str, losses: dict) -> str:
    """Megatron's validation block; perplexity is exp(min(20, loss))."""
    body = f" {prefix} | " + "".join(
        f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(20.0, v)):.6E} | " for k, v in losses.items()
    )
    rule = "-" * (len(body) + 1)
    return f"{rule}\n{body}\n{rule}"


class MetricsWriter:
    """Writes each logged record, as built once by the log line, to TensorBoard, Weights & Biases and a
    JSON-lines file (each optional); only the rank that owns the loss has one that is enabled.

    The metrics file and W&B hold the values as computed (float64, ints as ints); TensorBoard stores
    float32. TensorBoard's step axis is the iteration; each scalar is also written against the
    consumed samples (``<name> vs samples``) in the ``vs-samples`` run below it. A run resumed at
    iteration k (``resumed_at``) purges what an earlier run wrote there for steps after k (TensorBoard's
    ``purge_step``: a resume from an older checkpoint leaves no duplicate steps) and continues the W&B
    run ``wandb_run_id`` (``resume="allow"``)."""

    def __init__(
        self,
        enabled: bool,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | None = None,
        metrics_file: str | None = None,
        run_config: dict | None = None,
        wandb_entity: str | None = None,
        log_loss_scale: bool = True,
        resumed_at: tuple[int, int] = (0, 0),
        wandb_run_id: str | None = None,
    ):
        """``log_loss_scale`` False drops the "loss-scale" scalar (--no-log-loss-scale-to-tensorboard:
        the log line still shows it); ``resumed_at`` is the (iteration, consumed samples) the run
        starts from."""
        self.enabled = enabled
        self.tb = self.tb_samples = self.wandb = self.jsonl = None
        self.log_loss_scale = log_loss_scale
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            iteration, samples = resumed_at
            self.tb = SummaryWriter(
                tensorboard_dir, max_queue=1000, purge_step=iteration + 1 if iteration else None
            )
            self.tb_samples = SummaryWriter(
                os.path.join(tensorboard_dir, "vs-samples"),
                max_queue=1000,
                purge_step=samples + 1 if samples else None,
            )
        if wandb_project:
            import wandb

            save_dir = wandb_save_dir or tensorboard_dir or "."
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=wandb_project,
                name=wandb_exp_name,
                dir=save_dir,
                config=run_config,
                entity=wandb_entity,
                id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.jsonl = open(metrics_file, "a", buffering=1)

    def log_scalars(self, scalars: dict, iteration: int, consumed_samples: int) -> None:
        """Write one record: ``scalars`` {name: number or None (absent)} at ``iteration``."""
        if not self.enabled:
            return
        clean = {k: v for k, v in scalars.items() if v is not None}
        if not self.log_loss_scale:
            clean.pop("loss-scale", None)
        if self.tb is not None and self.tb_samples is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, iteration)
                self.tb_samples.add_scalar(f"{k} vs samples", v, consumed_samples)
        if self.wandb is not None:
            self.wandb.log(clean, step=iteration)
        if self.jsonl is not None:
            record = {
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "time": time.time(),
                **clean,
            }
            self.jsonl.write(json.dumps(record) + "\n")

    def close(self) -> None:
        for tb in (self.tb, self.tb_samples):
            if tb is not None:
                tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()


def wandb_run_id(cfg, saved: str | None) -> str | None:
    """The W&B run this run writes to, the same on every rank: the one of the checkpoint loaded
    (``saved``), else with --wandb-project a new id (made on rank 0 and broadcast), else None."""
    if saved or not cfg.logger.wandb_project:
        return saved
    ids = [secrets.token_hex(6)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


def writer_kwargs(cfg, resumed_at: tuple[int, int] = (0, 0), wandb_run_id: str | None = None) -> dict:
    """``MetricsWriter``'s sinks for a run: --tensorboard-dir, W&B, and the metrics file (default
    ``metrics.jsonl`` in the TensorBoard or --save directory)."""
    lg, ck = cfg.logger, cfg.checkpoint
    metrics_file = lg.metrics_file
    run_dir = lg.tensorboard_dir or ck.save
    if metrics_file is None and run_dir:
        metrics_file = os.path.join(run_dir, "metrics.jsonl")
    return dict(
        tensorboard_dir=lg.tensorboard_dir,
        wandb_project=lg.wandb_project,
        wandb_exp_name=lg.wandb_exp_name,
        wandb_save_dir=lg.wandb_save_dir,
        metrics_file=metrics_file,
        run_config=cfg.to_dict(),
        wandb_entity=lg.wandb_entity,
        log_loss_scale=lg.log_loss_scale_to_tensorboard,
        resumed_at=resumed_at,
        wandb_run_id=wandb_run_id,
    )
