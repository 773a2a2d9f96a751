"""The Trainer's checkpoint saving: what a checkpoint holds of the run (TrainState), --save
of the model, optimizer, scheduler and FP8 state, and the --log-progress record in the save directory.

:class:`TrainerCheckpointing` is a base of :class:`megatron.training.training.Trainer`, which sets the
attributes it declares before any of its methods runs. Loading is ``trainer_resume``'s."""

from __future__ import annotations

import dataclasses
import os
import time

import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.core.fusions.fp8 import fp8_sharded_state_dict
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.arguments import RunConfig
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


class TrainerCheckpointing:
    """The checkpoint methods of the Trainer (a base class: the attributes below are the Trainer's)."""

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
            "sequence_parallel": bool(m.sequence_parallel),
            "use_distributed_optimizer": bool(ddp.use_distributed_optimizer),
            "use_torch_fsdp2": bool(ddp.use_torch_fsdp2),
        }

    def fp8_sharded_state_dict(self) -> dict:
        """Delayed FP8 scaling's amax histories (empty without FP8)."""
        return fp8_sharded_state_dict(self.model, self.pg.tp_rank, self.pg.dp_rank)

    def save(self) -> None:
        ck = self.cfg.checkpoint
        self.optimizer.finish_param_sync()  # every replica's weights are this step's
        extra = dataclasses.asdict(self.state)
        # ``args``: the shape-defining flags at the top (what a later --load checks), the full config below.
        checks = model_args_for_check(self.cfg, self.padded_vocab_size)
        args = {flag.lstrip("-").replace("-", "_"): value for flag, value in checks.items()}
        args["config"] = self.cfg.to_dict()
        args["vocab_size"] = getattr(self.tokenizer, "vocab_size", None)  # unpadded, for exports
        args["layout"] = self.layout()
        extra.update(args=args, checkpoint_version=3.0)
        check_nan = self.cfg.training.check_for_nan_in_loss_and_grad
        try:  # with the NaN check on, a state holding NaN/Inf is never saved: it cannot be trained on
            checkpointing.save_checkpoint(
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
            )
        except checkpointing.NonFiniteStateError as e:
            roots = checkpointing.checkpoint_advice.checkpoint_roots((ck.save, ck.load))
            raise TrainingDiverged(
                f"{e} (the step's gradient norm was finite: its update overflowed); "
                f"{checkpointing.checkpoint_advice.resume_advice(roots, self.state.iteration)}. Lower --lr, raise "
                "--lr-warmup-iters, check --clip-grad and the data, or pass --no-check-for-nan-in-loss-and-grad to "
                "save it anyway"
            ) from None
        self.log_progress("saved checkpoint")

    def poll_saves(self) -> None:
        """Called between steps: finish what a save started in the background, if it is done."""

    def wait_for_saves(self) -> None:
        """Called when training ends (or stops): every save started is complete when this returns."""

    def log_progress(self, event: str) -> None:
        """``--log-progress``: one line appended to <save>/progress.txt by rank 0 (Megatron's progress log:
        what happened, the iteration, samples, tokens and FLOPs so far, and this job's throughput)."""
        ck, lg, st = self.cfg.checkpoint, self.cfg.logger, self.state
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
