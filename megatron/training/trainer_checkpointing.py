"""The Trainer's checkpoint saving: what a checkpoint holds of the run (TrainState), --save
of the model, optimizer, scheduler and FP8 state (synchronous, or with --async-save written in the
background: ``poll_saves`` / ``wait_for_saves`` complete it), retention (--ckpt-keep-last,
--save-retain-interval, once a newer checkpoint is complete) and the --log-progress record in the save
directory.

:class:`TrainerCheckpointing` is a base of :class:`megatron.training.training.Trainer`, which sets the
attributes it declares before any of its methods runs. Loading is ``trainer_resume``'s."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta

import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.dist_checkpointing.async_save import AsyncWriter
from megatron.core.distributed import DistributedDataParallel
from megatron.core.fusions.fp8 import fp8_sharded_state_dict
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpoint_dirs, checkpointing
from megatron.training.arguments import RunConfig
from megatron.training.checkpoint_save import AsyncSave, finish_async_save
from megatron.training.loop_utils import model_args_for_check, print_rank_0


class TrainingDiverged(RuntimeError):
    """Training produced NaN/Inf; reported as one line by the command-line entry point."""


@dataclasses.dataclass
class TrainState:
    """What the loop advances; saved in every checkpoint."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_floating_point_operations_so_far: int = 0


@dataclasses.dataclass
class _PendingSave:
    """An asynchronous save in flight, with what its completion needs."""

    save: AsyncSave
    previous: int | None  # the iteration the tracker named when it started (rank 0)
    state: TrainState  # the run's state at the save, for --log-progress at completion


class TrainerCheckpointing:
    """The checkpoint methods of the Trainer (a base class: the attributes below are the Trainer's)."""

    _async_writer: AsyncWriter | None = None  # made at the first --async-save save, on every rank
    _pending_save: _PendingSave | None = None

    cfg: RunConfig
    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    pg: ParallelState
    state: TrainState
    padded_vocab_size: int
    tokenizer: object
    world_size: int
    start_time: float
    flops_at_start: int  # FLOPs of the loaded state: --log-progress reports this job's throughput
    job_id: str
    wandb_run_id: str | None = None  # the W&B run the checkpoints carry on (metrics.wandb_run_id)

    def model_sharded_state_dict(self) -> dict:
        """All chunks' tensors (keys are global layer names, so any layout reads any other)."""
        if len(self.model) == 1:
            return self.model[0].sharded_state_dict()
        return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.model)}

    def layout(self) -> dict:
        """The run's parallel layout as a checkpoint records it (``args['layout']``)."""
        m, ddp = self.cfg.model, self.cfg.ddp
        return {
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.pg.tp_size,
            "pipeline_model_parallel_size": self.pg.pp_size,
            "virtual_pipeline_model_parallel_size": len(self.model),
            "data_parallel_size": self.pg.dp_size,
            "context_parallel_size": self.pg.cp_size,
            "sequence_parallel": bool(m.sequence_parallel),
            "use_distributed_optimizer": bool(ddp.use_distributed_optimizer),
            "use_torch_fsdp2": bool(ddp.use_torch_fsdp2),
            **(
                {
                    "expert_model_parallel_size": self.pg.ep_size,
                    "expert_tensor_parallel_size": self.pg.expt_tp_size,
                }
                if getattr(m, "num_moe_experts", None)
                else {}
            ),
        }

    def fp8_sharded_state_dict(self) -> dict:
        """Delayed FP8 scaling's amax histories (empty without FP8)."""
        return fp8_sharded_state_dict(self.model, self.pg.tp_rank, self.pg.dp_cp_rank)  # cp ranks: replicas

    def save(self) -> None:
        """Save the run's state to --save. Synchronous: returns once the checkpoint is complete and
        tracked. --async-save: waits for the previous save, then returns once the state is staged in
        host memory (the stall printed); ``poll_saves`` or ``wait_for_saves`` completes it."""
        ck = self.cfg.checkpoint
        self._finish_pending_save()  # one save at a time: the staged buffers are reused
        started = time.monotonic()
        previous = self._tracked_iteration()
        self.optimizer.finish_param_sync()  # every replica's weights are this step's
        extra = dataclasses.asdict(self.state)
        # ``args``: the shape-defining flags at the top (what a later --load checks), the full config below.
        checks = model_args_for_check(self.cfg, self.padded_vocab_size)
        args = {flag.lstrip("-").replace("-", "_"): value for flag, value in checks.items()}
        args["config"] = self.cfg.to_dict()
        args["vocab_size"] = getattr(self.tokenizer, "vocab_size", None)  # unpadded, for exports
        args["layout"] = self.layout()
        extra.update(args=args, checkpoint_version=3.0)
        if self.wandb_run_id:  # a run resumed from this checkpoint continues the same W&B run
            extra["wandb_run_id"] = self.wandb_run_id
        check_nan = self.cfg.training.check_for_nan_in_loss_and_grad
        try:  # with the NaN check on, a state holding NaN/Inf is never saved: it cannot be trained on
            pending = checkpointing.save_checkpoint(
                ck.save,
                self.state.iteration,
                self.model_sharded_state_dict(),
                self.optimizer,
                self.scheduler,
                extra_state=extra,
                parallel_state=self.pg,
                rng_state_fn=self.pg.rng_tracker.get_states,
                save_optim=ck.save_optim,
                save_rng=ck.save_rng,
                fp8_state=self.fp8_sharded_state_dict(),
                require_finite=check_nan,
                log=print_rank_0,
                writer=self._writer() if ck.async_save else None,
            )
        except checkpointing.NonFiniteStateError as e:
            roots = checkpointing.checkpoint_advice.checkpoint_roots((ck.save, ck.load))
            raise TrainingDiverged(
                f"{e} (the step's gradient norm was finite: its update overflowed); "
                f"{checkpointing.checkpoint_advice.resume_advice(roots, self.state.iteration)}. Lower --lr, raise "
                "--lr-warmup-iters, check --clip-grad and the data, or pass --no-check-for-nan-in-loss-and-grad to "
                "save it anyway"
            ) from None
        state = dataclasses.replace(self.state)
        if pending is None:
            self._saved(state, previous)
            return
        self._pending_save = _PendingSave(pending, previous, state)
        print_rank_0(
            f"  asynchronous save of iteration {state.iteration:7d} started: training stalled "
            f"{time.monotonic() - started:.2f} s (staging the state to host memory); the files are written "
            "in the background"
        )

    def poll_saves(self) -> None:
        """Called between steps: complete an asynchronous save whose files are written (rank 0 renames
        it and points the tracker at it); never blocks.

        Raises:
            CheckpointWriteError: its files could not be written (the tracker names the previous one).
        """
        if self._pending_save is not None and self._pending_save.save.done():
            self._finish_pending_save()

    def wait_for_saves(self) -> None:
        """Called when training ends (or stops): every save started is complete when this returns; the
        host buffers of --async-save are freed (a later save allocates them again).

        Raises:
            CheckpointWriteError: as ``poll_saves``.
        """
        try:
            self._finish_pending_save()
        finally:
            if self._async_writer is not None:
                self._async_writer.close()
                self._async_writer = None

    def _finish_pending_save(self) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        if not pending.save.done():
            waited = time.monotonic()
            pending.save.write.wait()  # its outcome (an error, with the cleanup) is finish_async_save's
            print_rank_0(
                f"  waited {time.monotonic() - waited:.2f} s for the asynchronous save of iteration "
                f"{pending.save.iteration:7d} to finish"
            )
        finish_async_save(pending.save, log=print_rank_0)
        self._saved(pending.state, pending.previous)

    def _writer(self) -> AsyncWriter:
        """The writer of --async-save: made on every rank at the first save (all ranks save together)."""
        if self._async_writer is None:
            minutes = self.cfg.training.distributed_timeout_minutes
            self._async_writer = AsyncWriter(timeout=timedelta(minutes=minutes))
        return self._async_writer

    def _tracked_iteration(self) -> int | None:
        """Rank 0: the iteration --save's tracker names (None without one or on other ranks)."""
        if dist.get_rank() != 0:
            return None
        try:
            return checkpoint_dirs.read_tracker(self.cfg.checkpoint.save)
        except CheckpointError:
            return None

    def _saved(self, state: TrainState, previous: int | None) -> None:
        """A checkpoint of ``state`` is complete and tracked: retention (rank 0), then --log-progress."""
        ck = self.cfg.checkpoint
        if dist.get_rank() == 0 and (ck.ckpt_keep_last is not None or ck.save_retain_interval is not None):
            checkpoint_dirs.apply_retention(
                ck.save, state.iteration, previous, ck.ckpt_keep_last, ck.save_retain_interval, print_rank_0
            )
        self.log_progress("saved checkpoint", state)

    def log_progress(self, event: str, state: TrainState | None = None) -> None:
        """``--log-progress``: one line appended to <save>/progress.txt by rank 0 (Megatron's progress log:
        what happened, the iteration, samples, tokens and FLOPs so far (of ``state``, default the run's
        now), and this job's throughput)."""
        ck, lg, st = self.cfg.checkpoint, self.cfg.logger, state or self.state
        if not (lg.log_progress and ck.save) or dist.get_rank() != 0:
            return
        seconds = max(time.time() - self.start_time, 1e-9)
        tflops = (
            (st.num_floating_point_operations_so_far - self.flops_at_start) / seconds / self.world_size / 1e12
        )
        tokens = st.consumed_train_samples * self.cfg.training.seq_length
        fields = [
            time.strftime("%Y-%m-%d %H:%M:%S"),
            f"job id: {self.job_id}",
            f"processes: {self.world_size}",
            event,
            f"iteration: {st.iteration}",
            f"consumed samples: {st.consumed_train_samples}",
            f"tokens: {tokens}",
            f"floating-point operations: {st.num_floating_point_operations_so_far}",
            f"job throughput: {tflops:.3g} TFLOP/s per process",
        ]
        os.makedirs(ck.save, exist_ok=True)
        with open(os.path.join(ck.save, "progress.txt"), "a") as f:
            f.write("\t".join(fields) + "\n")
