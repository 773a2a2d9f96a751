"""The training application: set-up, the loop, evaluation, when to checkpoint, and exits (checkpoint I/O:
trainer_checkpointing)."""

from __future__ import annotations

import math
import os
import signal
import time

import torch
import torch.distributed as dist

from megatron.core.distributed import finalize_model_grads
from megatron.core.fusions.fp8 import Fp8Gemm
from megatron.core.num_microbatches_calculator import set_num_microbatches_calculator
from megatron.core.optimizer import DistributedOptimizer, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import memory_report
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.training.arguments import RunConfig, format_arguments
from megatron.training.data_faults import DataFault, name_data_faults
from megatron.training.execution_setup import (
    amax_reducer,
    apply_compile_choice,
    compile_model,
    layout_lines,
    resolve_plan,
)
from megatron.training.flops import num_floating_point_operations, peak_tflops, shape_from_config
from megatron.training.initialize import (
    configure_job_watch,
    initialize_distributed,
    note_iteration,
    set_random_seeds,
)
from megatron.training.loop_utils import (
    DistributedSignalHandler,
    InFlightStep,
    IntervalLog,
    build_batch_calculator,
    build_scheduler,
    is_last_rank,
    print_rank_0,
    print_rank_last,
    train_iters_of,
)
from megatron.training.memory_estimate import report_memory
from megatron.training.metrics import MetricsWriter, wandb_run_id, writer_kwargs
from megatron.training.model_wrapping import grad_stats_group, model_build_device, wrap_model_chunks
from megatron.training.moe_metrics import MoEStepHooks
from megatron.training.profiling import OPTIMIZER_RANGE, StepProfiler
from megatron.training.timers import build_timers
from megatron.training.trainer_checkpointing import TrainingDiverged as TrainingDiverged
from megatron.training.trainer_checkpointing import TrainState as TrainState
from megatron.training.trainer_events import TrainerEvents
from megatron.training.trainer_rerun import TrainerRerun
from megatron.training.trainer_resume import TrainerResume
from megatron.training.validation import batch_schedule_flag, check_batch_schedule


class Trainer(TrainerResume, TrainerRerun, TrainerEvents):
    """Owns the model, optimizer, schedule, data iterators and writers of one run."""

    def __init__(self, cfg: RunConfig, providers):
        self.cfg = cfg
        self.providers = providers
        self.start_time = time.time()
        self.job_id = os.environ.get("SLURM_JOB_ID", "local")  # for --log-progress, read once
        t = cfg.training
        self.device, self.pg = initialize_distributed(
            t.distributed_backend,
            t.distributed_timeout_minutes,
            tp=cfg.model.tensor_model_parallel_size,
            pp=cfg.model.pipeline_model_parallel_size,
            cp=cfg.model.context_parallel_size,
            hierarchical_cp=cfg.model.hierarchical_context_parallel_sizes,
            ep=cfg.model.expert_model_parallel_size,
            etp=cfg.model.expert_tensor_parallel_size,
        )
        self.world_size = dist.get_world_size()
        configure_job_watch(cfg)  # the hang report's flags and directory, --log-straggler
        if cfg.impl.disable_bf16_reduced_precision_matmul:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        set_random_seeds(t.seed, self.pg.pp_rank)
        # Dropout inside tensor-parallel regions draws from this tracker (seed + 2718 + tp rank).
        self.pg.rng_tracker = model_parallel_seed(t.seed, self.pg.tp_rank, device=self.device)
        print_rank_0(format_arguments(cfg))
        if self.pg.pp_size > 1:
            print_rank_0(cfg.model.pipeline_layout().table())
        for line in layout_lines(cfg, self.world_size):
            print_rank_0(line)
        self.tokenizer, self.padded_vocab_size = providers.tokenizer(cfg, self.pg)
        # Every implementation choice, once, before the model: the layers are built from it.
        self.plan = resolve_plan(cfg, self.device, self.pg.tp_size)
        self.amax_reducer = amax_reducer(self.plan, self.pg, cfg.model.tp_only_amax_red)
        apply_compile_choice(cfg, self.plan)
        chunks = providers.model(
            cfg,
            self.padded_vocab_size,
            self.pg,
            model_build_device(cfg, self.device),
            plan=self.plan,
            amax_reducer=self.amax_reducer,
        )
        chunks = chunks if isinstance(chunks, list) else [chunks]
        num_params = sum(p.numel() for c in chunks for p in c.parameters())
        if self.pg.dp_rank == 0:  # one line per (tp, pp) rank, as Megatron prints it
            print(
                f" > number of parameters on (tensor, pipeline) model parallel rank "
                f"({self.pg.tp_rank}, {self.pg.pp_rank}): {num_params}",
                flush=True,
            )
        compile_model(self.plan, chunks)
        fp8_linears = sum(isinstance(m, Fp8Gemm) for c in chunks for m in c.modules())
        documents = cfg.data.reset_attention_mask
        print_rank_0("\n".join(self.plan.report_lines(cfg.optimizer, fp8_linears, documents)))
        report_memory(cfg, self.padded_vocab_size, self.world_size, self.plan, self.device, dist.get_rank())
        # One DDP (or FSDP2) wrapper per model chunk, as Megatron-Core does for virtual stages.
        self.model = wrap_model_chunks(cfg, chunks, self.pg, self.device)
        cfg.model.finalize_model_grads_func = finalize_model_grads
        cfg.model.no_sync_func = (
            [c.no_sync for c in self.model] if len(self.model) > 1 else self.model[0].no_sync
        )
        self.optimizer = get_megatron_optimizer(
            cfg.optimizer,
            list(self.model),
            grad_stats_group=grad_stats_group(cfg, self.pg),
            tp_rank=self.pg.tp_rank,
        )
        if isinstance(self.optimizer, DistributedOptimizer):
            print_rank_0(memory_report(self.optimizer, self.model))
        offload = self.optimizer.offload_summary()
        if offload is not None:
            print_rank_0(f" > {offload}")
        if cfg.model.fp16:
            cfg.model.grad_scale_func = self.optimizer.scale_loss
        # The final global batch size; evaluation always runs it. Training steps follow the schedule.
        self.global_batch_size = t.global_batch_size
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.pg.dp_size)
        self.batch_sizes = build_batch_calculator(cfg, self.pg.dp_size, dist.get_rank(), print_rank_0)
        set_num_microbatches_calculator(self.batch_sizes)  # for user code that calls get_num_microbatches()
        self.train_iters = train_iters_of(cfg, self.batch_sizes)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.train_iters)
        self.state = TrainState()
        self._load()
        self._start_batch_schedule()
        self.flops_shape = shape_from_config(cfg.model, self.padded_vocab_size)
        self.flops_per_step = self.step_flops(t.global_batch_size)
        self.flops_at_start = self.state.num_floating_point_operations_so_far  # after --load
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_tflops = peak_tflops(device_name)
        if self.peak_tflops is None:
            print_rank_0(
                f" > MFU is not known for device {device_name or 'cpu'} (no dense bf16 peak on record)"
            )
        self.moe = MoEStepHooks(cfg.model, self.pg) if cfg.model.num_moe_experts else None
        self.moe_metrics: dict[int, dict] = {}  # the MoE log values read at a logged step, by iteration
        self.forward_backward = get_forward_backward_func(self.pg.pp_size, len(self.model))
        (self.train_iter, self.valid_iter, self.test_iter), self.has_split = providers.data_iterators(self)
        self.train_iter = self.wrap_train_iterator(self.train_iter)
        self._loading = 0  # the iteration whose micro-batches are being loaded, for a data fault's line
        self.train_iter = name_data_faults(self.train_iter, self._loading_what)
        self._build_guard()
        self.wandb_run_id = wandb_run_id(cfg, self.wandb_run_id)  # the checkpoint's W&B run, else a new one
        resumed_at = (self.state.iteration, self.state.consumed_train_samples)  # TensorBoard's purge step
        self.writer = MetricsWriter(is_last_rank(), **writer_kwargs(cfg, resumed_at, self.wandb_run_id))
        self.timers = build_timers(self)  # --timing-log-level: hooks the data iterator, grads and optimizer
        self.signal_handler = (
            DistributedSignalHandler((getattr(signal, t.exit_signal), signal.SIGINT))
            if t.exit_signal_handler
            else None
        )

    def _loading_what(self) -> str:
        return f"a micro-batch of iteration {self._loading} (data-parallel rank {self.pg.dp_rank})"

    # ----------------------------------------------------------------------------------------------
    def _start_batch_schedule(self) -> None:
        """Check the batch sizes still to come against this layout (a resumed run from its consumed
        samples on) and describe a ramp."""
        t, b = self.cfg.training, self.batch_sizes
        consumed = self.state.consumed_train_samples
        if self.cfg.checkpoint.load:
            check_batch_schedule(self.cfg, self.pg.dp_size, consumed)
        b.update(consumed, consistency_check=True)
        if b.final_from() == 0:
            return
        print_rank_0(
            f" > {batch_schedule_flag(self.cfg)}: global batch size {b.get_current_global_batch_size()} "
            f"at {consumed} consumed samples, {b.global_batch_size} from {b.final_from()} samples on; "
            f"{self.train_iters} iterations"
        )
        if t.train_iters is not None:
            print_rank_0(
                f" > note: with --train-iters, the iteration lengths of the LR schedule are converted to "
                f"samples at the final global batch size {b.global_batch_size} (as in Megatron); the "
                "ramp's smaller steps stretch them: use --train-samples and --lr-*-samples to avoid that"
            )

    def step_batch_size(self, consumed_samples: int) -> int:
        """The samples of the step that starts after ``consumed_samples`` (the schedule's running size)."""
        return self.batch_sizes.running_batch_size(self.batch_sizes.global_batch_size_at(consumed_samples))

    def step_flops(self, batch_size: int) -> int:
        return num_floating_point_operations(self.flops_shape, batch_size, self.cfg.training.seq_length)

    # ----------------------------------------------------------------------------------------------
    def train_step(
        self,
        sync: bool = True,
        num_microbatches: int | None = None,
        global_batch_size: int | None = None,
        iteration: int = 0,
        run: str = "first",
    ):
        """One optimizer step over ``num_microbatches`` micro-batches of ``global_batch_size`` samples
        in all (default: the final batch size's). Returns (loss sum/count tensors, update_successful,
        grad_norm, num_zeros); with ``sync=False`` the grad norm and zero count (and, with the step
        checks on, update_successful) are device tensors and nothing waits for the device (see
        :class:`InFlightStep`). The LR schedule advances by the step's samples, a rejected step's too
        (it consumes them). ``run``: ``first``, ``re-run`` (megatron.training.rerun) or ``stats``
        (report_stats' first run, rejected)."""
        num_microbatches = self.num_microbatches if num_microbatches is None else num_microbatches
        global_batch_size = self.global_batch_size if global_batch_size is None else global_batch_size
        self.timers.next_step(iteration)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        t = self.cfg.training
        guard = getattr(self, "guard", None)
        if guard is not None:
            guard.arm(iteration, self.model, rerun=run == "re-run")
        self.timers("forward-backward").start()
        metrics = self.forward_backward(
            forward_step_func=self.providers.forward_step,
            data_iterator=self.train_iter,
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=t.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
        self.timers("forward-backward").stop()
        # Before the step: NCCL runs a communicator's collectives in the order they were issued, and
        # the step ends by queueing the weight broadcasts (--use-distributed-optimizer) on the same
        # data-parallel communicator; a loss all-reduce queued after them would hold the next forward
        # until every broadcast had run (docs/performance.md, the loss all-reduce's place).
        losses = self._reduce_losses(metrics)
        reject = None
        self.step_checks: dict = {}
        if guard is not None:
            guard.disarm()
            forced = iteration in guard.skip or run == "stats"
            flags = guard.reject_flags(iteration, losses, forced)
            reject = guard.reject(flags)
            self.step_checks = {"flags": flags, "forced": forced, "local_losses": self._local_losses}
        self.timers("optimizer").start()
        with torch.profiler.record_function(OPTIMIZER_RANGE):  # the profile's optimizer category (--profile)
            success, grad_norm, num_zeros = (
                self.optimizer.step(sync=sync)
                if reject is None
                else self.optimizer.step(sync=sync, reject=reject)
            )
        self.timers("optimizer").stop()
        if guard is not None:
            guard.after_update(losses, success)
            self.step_checks["local_norms"] = [getattr(c, "local_grad_norms", []) for c in self.model]
            if guard.reruns:  # the next step queued before this one is read must not update
                guard.poison = None if forced else (~success if torch.is_tensor(success) else None)
        if self.moe is not None:  # the routers' expert bias and global-batch counts, once per step
            self.moe.after_step(self.model, num_microbatches)
        if torch.is_tensor(success) or success:
            self.scheduler.step(increment=global_batch_size)
        return losses, success, grad_norm, num_zeros

    def _reduce_losses(self, metrics: list) -> dict:
        """Token-weighted sums over micro-batches and data- and context-parallel ranks:
        {name: tensor([sum, count])}."""
        out, self._local_losses = {}, {}
        for key in metrics[0] if metrics else []:
            total = torch.stack([m[key].detach().float() for m in metrics]).sum(0)
            self._local_losses[key] = total.clone() if self.pg.dp_cp_size > 1 else total
            if self.pg.dp_cp_size > 1:  # cp ranks hold other tokens of the same samples
                dist.all_reduce(total, group=self.pg.dp_cp_group)
            out[key] = total
        return out

    # ----------------------------------------------------------------------------------------------
    def _launch(self, iteration: int, consumed_samples: int, run: str = "first") -> InFlightStep:
        """Queue step ``iteration``, which starts after ``consumed_samples`` samples."""
        b = self.batch_sizes
        b.update(consumed_samples, consistency_check=True, verbose=True)
        self._loading = iteration
        if self.replay is not None:  # what a re-run of this step needs: its batches, random state, schedule
            self.replay.begin(iteration)
            self.random_state.save(iteration)
            groups = [(g["lr"], g.get("weight_decay")) for g in self.optimizer.param_groups]
            self.schedule_state[iteration] = (self.scheduler.num_steps, groups)
            for old in [k for k in self.schedule_state if k < iteration - 1]:
                del self.schedule_state[old]
        losses, success, grad_norm, num_zeros = self.train_step(
            sync=False,
            num_microbatches=b.get(),
            global_batch_size=b.get_current_running_global_batch_size(),
            iteration=iteration,
            run=run,
        )
        checks = self.step_checks
        # The log line of this step shows the learning rates and loss scale as they are now, and the
        # MoE losses and routing statistics of the steps since the last line (read on every rank).
        lr, decoupled_lr = self._learning_rates()
        if self.moe is not None and self._logs_at(iteration):
            self.moe_metrics[iteration] = self.moe.read()
        scalars = {"grad_norm": grad_norm, "num_zeros": num_zeros, "decoupled_lr": decoupled_lr}
        if torch.is_tensor(success):  # decided on the device: read with the step's other results
            scalars["applied"] = success
        step = InFlightStep(
            iteration,
            losses,
            success if not torch.is_tensor(success) else True,
            scalars,
            self._exit_flags(),
            self.device,
            lr=lr,
            loss_scale=float(self.optimizer.get_loss_scale()),
        )
        step.checks = checks  # type: ignore[attr-defined]
        step.consumed = consumed_samples  # type: ignore[attr-defined]
        return step

    def _learning_rates(self) -> tuple[float, float | None]:
        """(the learning rate, the --decoupled-lr groups' one or None) of the optimizer's groups."""
        lr = decoupled = None
        for group in self.optimizer.param_groups:
            if group.get("is_decoupled_lr"):
                decoupled = group["lr"]
            elif lr is None:
                lr = group["lr"]
        return (decoupled if lr is None else lr), decoupled

    def train(self) -> None:
        """The loop. Step k+1 is queued on the GPU before step k's loss and grad norm are read, so the
        GPU never waits for the host between steps (no sync inside a step, one event wait per step).
        Evaluation, saving and exits happen between steps with nothing queued behind them."""
        ck, lg = self.cfg.checkpoint, self.cfg.logger
        interval = IntervalLog(self)
        profiler = StepProfiler(lg, dist.get_rank(), self.device, lg.tensorboard_dir or ck.save)
        last_saved = self.state.iteration if ck.load else -1
        print_rank_0(f"training from iteration {self.state.iteration} to {self.train_iters}")
        self.log_progress("starting job")
        pending: InFlightStep | None = None
        reason = None
        data_fault: DataFault | None = None
        while True:
            launched = pending.iteration if pending is not None else self.state.iteration
            consumed = self.state.consumed_train_samples  # after `launched`: the pending step's samples added
            if pending is not None:
                consumed += self.step_batch_size(consumed)
            step = None
            in_step = self.guard is not None and self.guard.mode == "report_stats"  # every step run twice
            if (
                reason is None
                and launched < self.train_iters
                and (pending is None or not (in_step or self._needs_barrier(launched)))
            ):
                profiler.before_step(launched + 1)
                try:
                    step = self._launch(launched + 1, consumed, run="stats" if in_step else "first")
                except DataFault as e:
                    if self.world_size > 1:  # the other ranks wait inside the step: no checkpoint
                        raise DataFault(
                            f"{e}; no checkpoint was written: resume from the newest one"
                        ) from None
                    data_fault, reason, step = e, "data fault", None  # the step before it is saved below
                summary = profiler.after_step(launched + 1)
                if summary:
                    print(summary, flush=True)
            if pending is not None:
                losses, scalars, flags = pending.read()
                verdict = self._verdict(pending, losses, scalars, "first")
                if verdict.reasons or (in_step and self.guard is not None):
                    if step is not None:  # queued poisoned behind the rejected step: it comes again
                        step.read()
                        step = None
                    pending, losses, scalars, verdict = self._decide(pending, losses, scalars, verdict)
                success, grad_norm = verdict.applied, scalars["grad_norm"]
                if self.guard is not None and success:
                    self.guard.last_applied, self.guard.skipped_in_a_row = pending.iteration, 0
                self.state.iteration = pending.iteration
                note_iteration(self.state.iteration)  # for the heartbeat that names a lost rank
                batch = self.step_batch_size(self.state.consumed_train_samples)
                flops = self.step_flops(batch)
                self.state.consumed_train_samples += batch  # skipped (fp16 overflow) steps consume theirs too
                self.state.num_floating_point_operations_so_far += flops
                self.after_step(self.state.iteration)
                interval.record(
                    losses,
                    success,
                    grad_norm,
                    pending.lr,
                    pending.loss_scale,
                    pending.done,
                    scalars["num_zeros"],
                    pending.event,
                    global_batch_size=batch,
                    flops=flops,
                    decoupled_lr=scalars["decoupled_lr"],
                    moe=self.moe_metrics.pop(self.state.iteration, None),
                    non_finite=grad_norm is not None and not math.isfinite(grad_norm) and not success,
                )
                if self._logs_at(self.state.iteration):
                    interval.flush()
                    stats = self.guard.stats_line() if self.guard is not None else None
                    if stats:
                        print_rank_last(stats)
                if self._evaluates_at(self.state.iteration):
                    self.evaluate_and_print(f"validation loss at iteration {self.state.iteration}", 1)
                if self._saves_at(self.state.iteration):
                    self.save()
                    last_saved = self.state.iteration
                reason = reason or self._exit_reason(flags)
            self.poll_saves()
            pending = step
            if pending is None and (reason is not None or self.state.iteration >= self.train_iters):
                break
        if ck.save and last_saved != self.state.iteration:
            self.save()
        self.wait_for_saves()
        if data_fault is not None:
            saved = (
                f"iteration {self.state.iteration} was saved: resume from it with --load {ck.save}"
                if ck.save
                else "nothing was saved (no --save)"
            )
            raise DataFault(f"{data_fault}; {saved}") from None
        if reason:
            print_rank_0(reason)
            return
        self._final_evaluation()


def pretrain(cfg: RunConfig, providers) -> TrainState:
    """Build everything from ``cfg`` and train. ``providers`` supplies the model-specific pieces:
    ``tokenizer(cfg, pg)``, ``model(cfg, padded_vocab, pg, device)``, ``forward_step(iter, model)``
    and ``data_iterators(trainer)``."""
    trainer = Trainer(cfg, providers)
    try:
        if cfg.training.skip_train:
            trainer.skip_train()
        else:
            trainer.train()
    finally:
        trainer.writer.close()
        if trainer.signal_handler is not None:
            trainer.signal_handler.release()
    return trainer.state
