"""The Trainer's --load: restore the model, optimizer, scheduler, FP8 state and the run's position
from a checkpoint, and say what was resumed.

:class:`TrainerResume` is a base of :class:`megatron.training.training.Trainer` (``_load`` is called
from ``Trainer.__init__`` once the model, optimizer and scheduler exist; ``wrap_train_iterator`` once
the data iterators exist; ``after_step`` after each step's results are read)."""

from __future__ import annotations

import dataclasses

from megatron.core.distributed.finalize_model_grads import sync_shared_embedding
from megatron.core.fusions.fp8 import fp8_state_loaded
from megatron.training import checkpointing
from megatron.training.loop_utils import gelu_change_note, model_args_for_check, print_rank_0
from megatron.training.trainer_checkpointing import TrainerCheckpointing, TrainState


class TrainerResume(TrainerCheckpointing):
    """The load methods of the Trainer (a base class: the attributes are the Trainer's)."""

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
        )
        if extra is None:
            return
        note = gelu_change_note(extra.get("args", {}), self.cfg.model)
        if note:
            print_rank_0(note)
        fp8_state_loaded(self.model)
        sync_shared_embedding(self.model)  # the checkpoint holds the first stage's embedding only
        if ck.finetune or not ck.load_optim:
            self.optimizer.reload_model_params()
        if not ck.finetune:
            for f in dataclasses.fields(TrainState):
                setattr(self.state, f.name, int(extra.get(f.name, 0)))

    def wrap_train_iterator(self, train_iter):
        """The training data iterator the loop reads (called once, after the iterators exist)."""
        return train_iter

    def after_step(self, iteration: int) -> None:
        """Called once step ``iteration``'s results are read (its batch has been consumed)."""
