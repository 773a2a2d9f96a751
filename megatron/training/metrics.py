"""Where training numbers go: the stdout log line (Megatron's format), TensorBoard, W&B and JSONL.

Only the rank that owns the loss (the last rank) writes; other ranks get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from datetime import datetime

from megatron.training.moe_metrics import format_moe_metrics


def format_iteration_line(it: int, train_iters: int, stats: dict) -> str:
    """One training log line: Megatron's fields in Megatron's order, plus tokens/s and MFU after the
    throughput (``stats`` keys as in ``Trainer._log``)."""
    parts = [
        f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {it:8d}/{train_iters:8d}",
        f"consumed samples: {stats['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {stats['iteration_time_ms']:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {_tflops(stats['tflops_per_gpu'])}",
        f"tokens per second per GPU: {stats['tokens_per_sec_per_gpu']:.1f}",
        "MFU: " + (f"{stats['mfu'] * 100:.1f}%" if stats.get("mfu") is not None else "n/a"),
        f"learning rate: {stats['learning_rate']:.6E}",
    ]
    if stats.get("decoupled_learning_rate") is not None:  # --decoupled-lr, on stages that hold those params
        parts.append(f"decoupled learning rate: {stats['decoupled_learning_rate']:.6E}")
    parts.append(f"global batch size: {stats['global_batch_size']:5d}")
    for key, value in stats["losses"].items():
        parts.append(f"{key}: {value:.6E}")
    parts += format_moe_metrics(stats.get("moe") or {})
    parts.append(f"loss scale: {stats['loss_scale']:.1f}")
    if stats.get("grad_norm") is not None:
        parts.append(f"grad norm: {stats['grad_norm']:.3f}")
    if stats.get("num_zeros") is not None:
        parts.append(f"num zeros: {stats['num_zeros']:.1f}")
    if stats.get("params_norm") is not None:
        parts.append(f"params norm: {stats['params_norm']:.3f}")
    parts.append(f"number of skipped iterations: {stats['skipped_iterations']:3d}")
    parts.append(f"number of nan iterations: {stats['nan_iterations']:3d}")
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
    """Fans scalars out to TensorBoard, Weights & Biases and a JSON-lines file (each optional)."""

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
        world_size: int | None = None,
    ):
        """``log_loss_scale`` False drops the "loss-scale" scalar; ``world_size`` (when given) is added
        as "world-size" to every record that carries the training scalars (those with a learning rate)."""
        self.enabled = enabled
        self.tb = self.wandb = self.jsonl = None
        self.log_loss_scale, self.world_size = log_loss_scale, world_size
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
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
            )
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.jsonl = open(metrics_file, "a", buffering=1)

    def log_scalars(self, scalars: dict, iteration: int, consumed_samples: int) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items() if v is not None}
        if not self.log_loss_scale:
            clean.pop("loss-scale", None)
        if self.world_size is not None and "learning-rate" in clean:
            clean["world-size"] = float(self.world_size)
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, iteration)
                self.tb.add_scalar(f"{k} vs samples", v, consumed_samples)
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
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()


def writer_kwargs(cfg, world_size: int) -> dict:
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
        world_size=world_size if lg.log_world_size_to_tensorboard else None,
    )
