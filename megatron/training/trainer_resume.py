"""The Trainer's --load: restore the model, optimizer, scheduler, FP8 state and the run's position
from a checkpoint, and say what was resumed; --log-batch-fingerprint.

:class:`TrainerResume` is a base of :class:`megatron.training.training.Trainer` (``_load`` is called
from ``Trainer.__init__`` once the model, optimizer and scheduler exist; ``wrap_train_iterator`` once
the data iterators exist; ``after_step`` after each step's results are read).

On a load, rank 0 prints the resume block (``resume_report``) before any tensor is read, and its last
line, the fingerprint of the first batch after the load (``batch_fingerprint``), once that step's
results are read. With ``--log-batch-fingerprint`` every step's fingerprint is printed
(``batch fingerprint at iteration N: <hex>``). Without a load and without the flag no batch is hashed.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

from megatron.core.config_utils import ConfigError
from megatron.core.distributed.finalize_model_grads import sync_shared_embedding
from megatron.core.fusions.fp8 import fp8_state_loaded
from megatron.training import checkpointing
from megatron.training.batch_fingerprint import BatchFingerprints, gloo_dp_group
from megatron.training.loop_utils import gelu_change_note, model_args_for_check, print_rank_0
from megatron.training.resume_report import SCHEDULE_FLAGS, SCHEDULE_WHY, ResumeReport
from megatron.training.trainer_checkpointing import TrainerCheckpointing, TrainState


class TrainerResume(TrainerCheckpointing):
    """The load methods of the Trainer (a base class: the attributes are the Trainer's)."""

    _loaded_from: str | None = None  # the checkpoint directory loaded, for the resume block's last line
    _fingerprints: BatchFingerprints | None = None
    _consumed_before_step: int = 0

    def _check_before_read(self, common: dict, ckpt_dir: str) -> None:
        """Print the resume block and refuse what cannot be resumed, before any tensor is read."""
        report = ResumeReport.build(
            common,
            ckpt_dir,
            self.cfg.to_dict(),
            model_args_for_check(self.cfg, self.padded_vocab_size),
            self.layout(),
            vocab_size=getattr(self.tokenizer, "vocab_size", None),
            finetune=self.cfg.checkpoint.finetune,
        )
        schedule_error = self._schedule_error(common, report.weights_only)
        if schedule_error is not None:
            report.refuse(SCHEDULE_FLAGS, SCHEDULE_WHY)
        print_rank_0("\n".join(report.lines()))
        report.raise_if_refused(raised_elsewhere=SCHEDULE_FLAGS)
        if schedule_error is not None:
            raise schedule_error
        self._loaded_from = ckpt_dir

    def _schedule_error(self, common: dict, weights_only: bool) -> ConfigError | None:
        """The error the scheduler's load would raise for the checkpoint's schedule (a value differs and
        neither --override-opt-param-scheduler nor --use-checkpoint-opt-param-scheduler is given),
        found on a copy of the scheduler over copies of the optimizer's groups: nothing is changed."""
        saved = common.get("opt_param_scheduler")
        if saved is None or weights_only or not self.cfg.checkpoint.load_optim:
            return None
        probe = copy.copy(self.scheduler)
        probe.optimizer = SimpleNamespace(
            param_groups=[dict(g) for g in self.scheduler.optimizer.param_groups]
        )
        try:
            probe.load_state_dict(saved)
        except ConfigError as e:
            return e
        return None

    def _load(self) -> None:
        ck = self.cfg.checkpoint
        if not ck.load:
            return
        extra = checkpointing.load_checkpoint(
            ck.load,
            self.model_sharded_state_dict(),
            self.optimizer,
            self.scheduler,
            parallel_state=self.pg,
            load_optim=ck.load_optim,
            load_rng=ck.load_rng,
            finetune=ck.finetune,
            ckpt_step=ck.ckpt_step,
            rng_restore_fn=self.pg.rng_tracker.set_states,
            exit_on_missing_checkpoint=ck.exit_on_missing_checkpoint,
            model_args_check=model_args_for_check(self.cfg, self.padded_vocab_size),
            log=print_rank_0,
            fp8_state=self.fp8_sharded_state_dict(),
            check_common=self._check_before_read,
        )
        if extra is None:
            self._loaded_from = None
            return
        note = gelu_change_note(extra.get("args", {}), self.cfg.model)
        if note:
            print_rank_0(note)
        fp8_state_loaded(self.model)
        sync_shared_embedding(self.model)  # the checkpoint holds the first stage's embedding only
        weights_only = ck.finetune or bool(extra.get("converted_from"))
        if weights_only or not ck.load_optim:
            self.optimizer.reload_model_params()
        if not weights_only:
            for f in dataclasses.fields(TrainState):
                setattr(self.state, f.name, int(extra.get(f.name, 0)))
            self.wandb_run_id = extra.get("wandb_run_id")

    def wrap_train_iterator(self, train_iter):
        """The training data iterator the loop reads (called once, after the iterators exist): the
        one that hashes each sample's tokens where fingerprints are printed (a load, or
        --log-batch-fingerprint)."""
        self._consumed_before_step = self.state.consumed_train_samples
        if self._loaded_from is None and not self.cfg.logger.log_batch_fingerprint:
            return train_iter
        pg = self.pg
        chunk = self.model[0].module if hasattr(self.model[0], "module") else self.model[0]
        reads = bool(getattr(chunk, "pre_process", pg.pp_rank == 0)) and pg.tp_rank == 0
        group = gloo_dp_group(pg)  # the gather stays on the CPU: no device sync
        self._fingerprints = BatchFingerprints(reads, pg.dp_size, self.cfg.training.micro_batch_size, group)
        return self._fingerprints.wrap(train_iter)

    def after_step(self, iteration: int) -> None:
        """Called once step ``iteration``'s results are read (its batch has been consumed)."""
        fp = self._fingerprints
        if fp is None:
            return
        batch = self.state.consumed_train_samples - self._consumed_before_step
        self._consumed_before_step = self.state.consumed_train_samples
        digest = fp.step(batch)
        if self._loaded_from is not None:
            print_rank_0(f"  next batch (iteration {iteration}): fingerprint {digest}")
            self._loaded_from = None
        if self.cfg.logger.log_batch_fingerprint:
            print_rank_0(f"batch fingerprint at iteration {iteration}: {digest}")
        else:  # the block's line was the one asked for
            fp.stop()
            self._fingerprints = None
