"""The trainer's part of megatron.training.rerun: build the step checks, judge a read step, re-run a
rejected one in place per --rerun-mode, and stop on one that cannot be taken."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron.training import checkpointing
from megatron.training.loop_utils import InFlightStep, print_rank_last
from megatron.training.rerun import (
    SPIKE_FACTOR,
    RandomState,
    ReplayIterators,
    StepGuard,
    Verdict,
    first_bad_param,
    main_loss,
)
from megatron.training.trainer_checkpointing import TrainerCheckpointing, TrainingDiverged


class TrainerRerun(TrainerCheckpointing):
    """The step checks of the Trainer (a base class: the attributes are the Trainer's)."""

    device: torch.device
    train_iter: Any

    def _build_guard(self) -> None:
        """The checks on every step before its update (megatron.training.rerun), when any is on."""
        t = self.cfg.training
        self.guard: StepGuard | None = None
        self.replay: ReplayIterators | None = None
        armed = (
            t.check_for_nan_in_loss_and_grad
            or t.check_for_spiky_loss
            or t.iterations_to_skip
            or t.error_injection_rate
            or t.error_injection_iterations
            or t.rerun_mode == "report_stats"
        )
        if not armed:
            return
        self.guard = StepGuard(self.cfg, self.device, dist.get_rank())
        self.guard.last_applied = self.state.iteration
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for o in optimizers:
            o.skip_non_finite = t.check_for_nan_in_loss_and_grad
        for chunk in self.model:
            if hasattr(chunk, "check_local_grads"):
                chunk.check_local_grads = t.check_for_nan_in_loss_and_grad
        if t.rerun_mode != "disabled":
            self.replay = ReplayIterators(self.train_iter)
            self.train_iter = self.replay.iterators
            self.random_state = RandomState(self.pg.rng_tracker)
            self.schedule_state: dict[int, tuple] = {}

    def _verdict(self, step: InFlightStep, losses: dict, scalars: dict, run: str) -> Verdict:
        """Whether the read step's update was kept, and if it was rejected by a check, why and where
        (a collective: every rank knows the step was rejected, from the reduced flags)."""
        applied = step.success and scalars.get("applied", 1.0) > 0
        checks = getattr(step, "checks", {})
        guard = self.guard
        if applied or guard is None or checks.get("forced") or scalars.get("grad_norm") is None:
            return Verdict(applied)  # taken, or skipped as asked (--iterations-to-skip), or fp16 overflow
        flags = checks["flags"].tolist()
        local_losses = checks.get("local_losses", {})
        loss_bad = any(not math.isfinite(float(v[0])) for v in local_losses.values())
        param = first_bad_param(self.model, [n for norms in checks.get("local_norms", []) for n in norms])
        spike = None
        if flags[1] > 0:
            main = main_loss(losses)
            spike = f"{main[0] / max(main[1], 1.0):.4E}"
        local = {
            "rank": dist.get_rank(),
            "host": os.uname()[1],
            "device": str(self.device),
            "loss_bad": loss_bad,
            "spike": spike,
            "param": param,
        }
        reasons = []
        grad_norm = scalars.get("grad_norm")
        if grad_norm is not None and not math.isfinite(grad_norm):
            reasons.append(f"gradient norm {grad_norm}")
        loss_values = {k: v[0] / max(v[1], 1.0) for k, v in losses.items()}
        if any(not math.isfinite(v) for v in loss_values.values()):
            reasons.append("non-finite loss")
        if spike is not None or (not reasons and guard.check_spiky):
            reasons.append(f"loss spike (over {SPIKE_FACTOR:g}x the median of the last accepted steps)")
        return Verdict(False, reasons, guard.report(step.iteration, reasons, local, run))

    def _decide(self, step: InFlightStep, losses: dict, scalars: dict, verdict: Verdict):
        """A step the checks rejected (or, with report_stats, any step): re-run it in place per
        --rerun-mode, and return the step, losses, scalars and verdict the loop goes on with."""
        guard = self.guard
        assert guard is not None
        it = step.iteration
        if guard.mode == "report_stats":
            again, losses2, scalars2, verdict2 = self._rerun(step)
            a, b = main_loss(losses), main_loss(losses2)
            if a is not None and b is not None:
                guard.record_stats(
                    (a[0] / max(a[1], 1.0), scalars.get("grad_norm")),
                    (b[0] / max(b[1], 1.0), scalars2.get("grad_norm")),
                )
            if verdict2.reasons:
                self._diverged(it, verdict2.report, scalars2.get("grad_norm"), losses2)
            return again, losses2, scalars2, verdict2
        if guard.mode == "disabled":  # (spikes do not reject there)
            self._diverged(it, verdict.report, scalars.get("grad_norm"), losses)
        print_rank_last(
            f"warning: {verdict.report}; re-running iteration {it} in place (--rerun-mode validate_results)"
        )
        again, losses2, scalars2, verdict2 = self._rerun(step)
        if verdict2.applied:
            guard.skipped_in_a_row = 0
            print_rank_last(
                f"warning: iteration {it}: the re-run did not reproduce the fault (a transient error: check "
                "the hardware of the rank named above); the re-run's update is kept"
            )
            guard.track(it, "first_rerun_not_reproducible", verdict.report)
            return again, losses2, scalars2, verdict2
        if guard.skipped_in_a_row:  # two bad batches in a row: the weights are bad, not the data
            self._diverged(it, verdict2.report, scalars2.get("grad_norm"), losses2)
        guard.skipped_in_a_row += 1
        print_rank_last(
            f"warning: iteration {it}: the re-run reproduced it; the batch is skipped (its samples are "
            "consumed, the model is not updated)"
        )
        return again, losses2, scalars2, verdict2

    def _rerun(self, step: InFlightStep):
        """Step ``step.iteration`` again from the same weights, batches, random state and schedule."""
        assert self.replay is not None and self.guard is not None
        it = step.iteration
        self.replay.rewind([it, it + 1])
        self.random_state.restore(it)
        num_steps, groups = self.schedule_state[it]
        self.scheduler.num_steps = num_steps
        for g, (lr, wd) in zip(self.optimizer.param_groups, groups):
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
        self.guard.poison = None
        again = self._launch(it, step.consumed, run="re-run")  # type: ignore[attr-defined]
        losses, scalars, _ = again.read()
        self.guard.poison = None  # decided on the host: the next step is queued clean
        if it + 1 in self.random_state.saved:
            self.random_state.restore(it + 1)
        return again, losses, scalars, self._verdict(again, losses, scalars, "re-run")

    def _diverged(self, iteration: int, report: str, grad_norm, losses: dict | None = None) -> None:
        """Stop on a NaN/Inf (with --rerun-mode validate_results: one reproduced right after a skipped
        step) before the weights it would corrupt are trained on or saved. The model is untouched since
        the last applied step; the advice names the newest checkpoint older than that whose tensors were
        finite (a checkpoint of the same weights would repeat the NaN: resuming is exact)."""
        self.wait_for_saves()  # a checkpoint still being written completes, and the advice can name it
        it, advice = self.state.iteration, checkpointing.checkpoint_advice
        since = min(it, self.guard.last_applied) if self.guard is not None else it
        roots = advice.checkpoint_roots((self.cfg.checkpoint.save, self.cfg.checkpoint.load))
        bad = advice.saved_at(roots, it)
        repeats = f", which {bad} holds (resuming from it repeats this)" if bad else ""
        loss = {k: v[0] / max(v[1], 1.0) for k, v in (losses or {}).items()}
        raise TrainingDiverged(
            f"non-finite gradient norm ({grad_norm}) at iteration {iteration} (loss {loss}), computed from the "
            f"weights of iteration {it}{repeats}; {advice.resume_advice(roots, since)}. Lower --lr, raise "
            "--lr-warmup-iters, check --clip-grad and the data, or pass --no-check-for-nan-in-loss-and-grad to "
            f"continue anyway ({report})"
        )
