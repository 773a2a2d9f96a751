"""The trainer's evaluation and the loop's calendar: when it logs, evaluates, saves or exits, and the
exit flags every rank agrees on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.training.loop_utils import print_rank_0, print_rank_last, signal_name
from megatron.training.metrics import MetricsWriter, format_validation
from megatron.training.trainer_checkpointing import TrainerCheckpointing


class TrainerEvents(TrainerCheckpointing):
    """Evaluation and the loop's calendar of the Trainer (a base class: the attributes are the Trainer's)."""

    device: torch.device
    providers: Any
    forward_backward: Callable
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    has_split: list[bool]
    train_iter: Any
    valid_iter: Any
    test_iter: Any
    signal_handler: Any
    writer: MetricsWriter

    def _reduce_losses(self, metrics: list) -> dict:
        raise NotImplementedError  # the Trainer's

    def evaluate(self, data_iter, num_iters: int) -> dict:
        t = self.cfg.training
        for chunk in self.model:
            chunk.eval()
        sums: dict = {}
        with torch.no_grad():
            for _ in range(num_iters):
                metrics = self.forward_backward(
                    forward_step_func=self.providers.forward_step,
                    data_iterator=data_iter,
                    model=self.model,
                    num_microbatches=self.num_microbatches,
                    seq_length=t.seq_length,
                    micro_batch_size=t.micro_batch_size,
                    forward_only=True,
                )
                for k, v in self._reduce_losses(metrics).items():
                    sums[k] = sums.get(k, 0) + v
                self.state.consumed_valid_samples += self.global_batch_size
        for chunk in self.model:
            chunk.train()
        return {k: (v[0] / v[1].clamp(min=1)).item() for k, v in sums.items()}

    def evaluate_and_print(self, prefix: str, split: int, log_scalars: bool = True) -> None:
        """Evaluate split 1 (validation) or 2 (test) on every rank, if rank 0 built it."""
        lg = self.cfg.logger
        if not self.has_split[split] or lg.eval_iters == 0:
            return
        data_iter = (self.train_iter, self.valid_iter, self.test_iter)[split]
        losses = self.evaluate(data_iter, lg.eval_iters)
        print_rank_last(format_validation(prefix, losses))
        if log_scalars:
            scalars = {}
            for k, v in losses.items():
                scalars[f"{k} validation"] = v
                scalars[f"{k} validation ppl"] = float(torch.tensor(min(20.0, v)).exp())
            self.writer.log_scalars(scalars, self.state.iteration, self.state.consumed_train_samples)

    def skip_train(self) -> None:
        """--skip-train: the evaluation that ends training, at the loaded iteration; nothing is trained
        or saved (Megatron's pretrain with --skip-train)."""
        print_rank_0(f"skipping training (--skip-train is on) at iteration {self.state.iteration}")
        self._final_evaluation()

    def _final_evaluation(self) -> None:
        self.evaluate_and_print(f"iteration {self.state.iteration} on validation set", 1, False)
        self.evaluate_and_print(f"iteration {self.state.iteration} on test set", 2, False)

    def _exit_flags(self) -> torch.Tensor | None:
        """This rank's [signal received (its number, 0: none), time is up] as a device tensor,
        max-reduced over ranks without waiting (read when the step's results are), or None when
        neither exit is enabled."""
        t = self.cfg.training
        if self.signal_handler is None and t.exit_duration_in_mins is None:
            return None
        late = (
            t.exit_duration_in_mins is not None
            and (time.time() - self.start_time) / 60.0 > t.exit_duration_in_mins
        )
        received = self.signal_handler is not None and self.signal_handler.received
        flags = torch.zeros(2, device=self.device)  # filled in place: no blocking host-to-device copy
        flags[0], flags[1] = float(received), float(late)
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def _logs_at(self, iteration: int) -> bool:
        return iteration % self.cfg.logger.log_interval == 0 or iteration == 1

    def _evaluates_at(self, iteration: int) -> bool:
        lg = self.cfg.logger
        started = lg.start_eval_at_iter is None or iteration >= lg.start_eval_at_iter
        return bool(lg.eval_interval and iteration % lg.eval_interval == 0 and started)

    def _saves_at(self, iteration: int) -> bool:
        ck = self.cfg.checkpoint
        return bool(ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def _exits_at(self, iteration: int) -> bool:
        t = self.cfg.training
        return bool(t.exit_interval and iteration % t.exit_interval == 0)

    def _exit_reason(self, flags: list[float] | None) -> str | None:
        t = self.cfg.training
        if flags is not None and flags[0] > 0:
            return f"exiting on {signal_name(flags[0])}"
        if flags is not None and flags[1] > 0:
            return f"exiting after {t.exit_duration_in_mins} minutes (--exit-duration-in-mins)"
        if self._exits_at(self.state.iteration):
            return f"exiting at iteration {self.state.iteration} (--exit-interval {t.exit_interval})"
        return None

    def _needs_barrier(self, iteration: int) -> bool:
        """Iterations after which the loop evaluates, saves or stops: the next step must not have
        started, so nothing is queued behind them."""
        return (
            iteration >= self.train_iters
            or self._evaluates_at(iteration)
            or self._saves_at(iteration)
            or self._exits_at(iteration)
        )
