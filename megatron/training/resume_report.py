"""The block a run prints when it loads a checkpoint: what it resumes, under which layout, and every
flag that differs from the saved run, each allowed or refused.

Built from the checkpoint's common values (``args``: the shape flags at the top level, ``config`` =
the saving run's ``RunConfig.to_dict()``, ``layout``, ``vocab_size``) before any tensor is read, so a
refusal stops the run before it reads the weights. Refused on every load: the shape flags
(``model_args_for_check``; their one-line-per-flag error is ``check_model_args``'s). Refused on a
resume (not on ``--finetune`` or a converted checkpoint, which start a new run from the weights):
another ``--tokenizer-type`` or another vocabulary size (the token ids would mean other tokens).
Everything else is allowed; the changes that make the resumed run read other data than the straight
run would (seed, sequence length, batch size, data) say so.

The block's last line (the fingerprint of the first batch after the load) is printed by the loop's
hooks once that batch is read: ``TrainerResume``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.dist_checkpointing import CheckpointError
from megatron.training.checkpoint_common import check_model_args, find_arg, quiet
from megatron.training.run_config import config_flags

# Sections and fields that never change what a resumed run computes (paths, logging, run length,
# exits) or that the layout line shows.
IGNORED_SECTIONS = ("checkpoint", "logger")
IGNORED_FIELDS = {
    "train_iters",
    "train_samples",
    "exit_interval",
    "exit_duration_in_mins",
    "exit_signal_handler",
    "exit_signal",
    "dry_run",
    "world_size",
    "distributed_timeout_minutes",
    "distributed_backend",
    "skip_train",
    "num_workers",
    "data_cache_path",
    "mmap_bin_files",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "sequence_parallel",
    "use_distributed_optimizer",
    "use_torch_fsdp2",
}
DATA_FIELDS = ("data_path", "split", "train_data_path", "data_args_path", "per_split_data_args_path")
# The flags of the learning-rate and weight-decay schedule that the checkpoint's scheduler state
# holds: a change is refused unless --override-opt-param-scheduler or --use-checkpoint-opt-param-scheduler.
SCHEDULE_FLAGS = (
    "--lr",
    "--min-lr",
    "--lr-decay-style",
    "--lr-warmup-iters",
    "--lr-warmup-samples",
    "--lr-warmup-fraction",
    "--lr-warmup-init",
    "--lr-decay-iters",
    "--lr-decay-samples",
    "--lr-wsd-decay-style",
    "--lr-wsd-decay-iters",
    "--lr-wsd-decay-samples",
    "--weight-decay",
    "--start-weight-decay",
    "--end-weight-decay",
    "--weight-decay-incr-style",
    "--decoupled-lr",
    "--decoupled-min-lr",
)
SCHEDULE_WHY = (
    "the checkpoint's schedule holds another value: pass --override-opt-param-scheduler to use this run's "
    "or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
)
# Tokenizer fields whose change is refused on a resume.
REFUSED_ON_RESUME = ("tokenizer_type",)


@dataclasses.dataclass
class FlagChange:
    """One flag whose value differs from the saved run's."""

    flag: str
    saved: Any
    current: Any
    refused: bool = False
    why: str = ""  # after "allowed: " / "refused: "; may be empty

    def line(self) -> str:
        verdict = "refused" if self.refused else "allowed"
        why = f": {self.why}" if self.why else ""
        return f"{self.flag}: {_show(self.flag, self.saved)} -> {_show(self.flag, self.current)} ({verdict}{why})"


def _show(flag: str, value: Any) -> str:
    """A value as the command line spells it (switches as on/off of the flag itself)."""
    if isinstance(value, bool):
        return "on" if value != flag.startswith("--no-") else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "[]"
    return "none" if value is None else str(value)


def _same(a: Any, b: Any) -> bool:
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return norm(a) == norm(b)


def layout_text(layout: dict | None) -> str:
    """``tp2 pp2 dp1 (4 ranks, distributed optimizer)`` for a checkpoint's ``args['layout']`` (``cp2``
    after the pipeline sizes with context parallelism, ``ep2 etp1`` after dp in a model with experts;
    checkpoints before them have none)."""
    if not layout:
        return "not recorded"
    vpp = layout.get("virtual_pipeline_model_parallel_size") or 1
    text = (
        f"tp{layout.get('tensor_model_parallel_size')} pp{layout.get('pipeline_model_parallel_size')}"
        + (f" vpp{vpp}" if vpp > 1 else "")
        + (f" cp{cp}" if (cp := layout.get("context_parallel_size") or 1) > 1 else "")
        + f" dp{layout.get('data_parallel_size')}"
    )
    if (ep := layout.get("expert_model_parallel_size")) is not None:
        text += f" ep{ep} etp{layout.get('expert_tensor_parallel_size')}"
    ranks = layout.get("world_size")
    extras = [f"{ranks} rank{'s' if ranks != 1 else ''}"]
    for key, name in (
        ("sequence_parallel", "sequence parallel"),
        ("use_distributed_optimizer", "distributed optimizer"),
        ("use_torch_fsdp2", "FSDP2"),
    ):
        if layout.get(key):
            extras.append(name)
    return f"{text} ({', '.join(extras)})"


def _why_allowed(field: str, saved: dict, current: dict, consumed: int) -> str:
    training = current.get("training", {})
    if field == "micro_batch_size":
        same = saved.get("training", {}).get("global_batch_size") == training.get("global_batch_size")
        return "same global batch" if same else ""
    if field == "global_batch_size":
        return f"the data continues at sample {consumed}"
    if field == "seed":
        return "the RNG states are the checkpoint's; the data order is the new seed's"
    if field == "seq_length":
        return f"the data continues at sample {consumed}, in samples of the new length"
    if field in DATA_FIELDS:
        return f"the data continues at sample {consumed} of the new data"
    return ""


def config_changes(
    saved: dict, current: dict, shape_flags: set[str], consumed: int, resume: bool
) -> list[FlagChange]:
    """The flags whose values differ between the saved ``config`` and the current one (fields in
    both, not ignored, not shape flags: those are ``shape_changes``')."""
    changes, seen = [], set(shape_flags)
    for (section, field), flag in config_flags().items():
        if section in IGNORED_SECTIONS or field in IGNORED_FIELDS or flag in seen:
            continue
        old, new = saved.get(section, {}), current.get(section, {})
        if field not in old or field not in new or _same(old[field], new[field]):
            continue
        seen.add(flag)
        if resume and field in REFUSED_ON_RESUME:
            why = "the token ids would mean other tokens"
            changes.append(FlagChange(flag, old[field], new[field], refused=True, why=why))
            continue
        changes.append(
            FlagChange(flag, old[field], new[field], why=_why_allowed(field, saved, current, consumed))
        )
    return changes


def shape_changes(saved_args: dict, checks: dict[str, Any]) -> list[FlagChange]:
    """The shape flags (``model_args_for_check``) whose saved values differ from ``checks``."""
    out = []
    for flag, current in checks.items():
        found, saved = find_arg(saved_args, flag.lstrip("-").replace("-", "_"))
        if found and not _same(saved, current):
            out.append(
                FlagChange(
                    flag, saved, current, refused=True, why="the checkpoint's tensors are of another model"
                )
            )
    return out


def vocab_change(saved_args: dict, vocab_size: int | None, resume: bool) -> list[FlagChange]:
    """The unpadded vocabulary size, where the checkpoint and the current tokenizer both know it."""
    saved = saved_args.get("vocab_size") if isinstance(saved_args, dict) else None
    if saved is None or vocab_size is None or saved == vocab_size:
        return []
    why = "the token ids would mean other tokens" if resume else "check that the ids mean the same tokens"
    return [FlagChange("vocabulary size (the tokenizer's)", saved, vocab_size, refused=resume, why=why)]


@dataclasses.dataclass
class ResumeReport:
    """What a load resumes and how the current run differs from the saved one (see the module doc)."""

    ckpt_dir: str
    common: dict
    current_layout: dict
    changes: list[FlagChange]
    weights_only: bool  # --finetune or a converted checkpoint: a new run from the weights
    shape_checks: dict[str, Any]
    flags_recorded: bool

    @classmethod
    def build(
        cls,
        common: dict,
        ckpt_dir: str,
        current_config: dict,
        shape_checks: dict[str, Any],
        current_layout: dict,
        vocab_size: int | None = None,
        finetune: bool = False,
    ) -> ResumeReport:
        """The report of loading the checkpoint ``ckpt_dir`` (common values ``common``) into a run of
        ``current_config`` (``RunConfig.to_dict()``), shape flags ``shape_checks``
        (``model_args_for_check``), layout ``current_layout`` and unpadded ``vocab_size``."""
        args = common.get("args") or {}
        args = args if isinstance(args, dict) else {}
        weights_only = finetune or bool(common.get("converted_from"))
        saved_config = args.get("config") if isinstance(args.get("config"), dict) else None
        changes = shape_changes(args, shape_checks)
        if saved_config is not None:
            consumed = int(common.get("consumed_train_samples", 0))
            changes += config_changes(
                saved_config, current_config, set(shape_checks), consumed, resume=not weights_only
            )
        changes += vocab_change(args, vocab_size, resume=not weights_only)
        return cls(
            ckpt_dir, common, current_layout, changes, weights_only, shape_checks, saved_config is not None
        )

    def header(self) -> str:
        c = self.common
        if c.get("converted_from"):
            return f"starting from {self.ckpt_dir} (converted from {c['converted_from']}): iteration 0, weights only"
        if self.weights_only:
            return (
                f"finetuning from {self.ckpt_dir} (--finetune): the weights of iteration {c.get('iteration', 0)}; "
                "iteration, consumed samples and optimizer start from 0"
            )
        return (
            f"resuming from {self.ckpt_dir}: iteration {c.get('iteration', 0)}, consumed samples "
            f"{c.get('consumed_train_samples', 0)} (valid {c.get('consumed_valid_samples', 0)})"
        )

    def lines(self) -> list[str]:
        """The block without its last line (the next batch's fingerprint)."""
        args = self.common.get("args") if isinstance(self.common.get("args"), dict) else {}
        saved, now = layout_text(args.get("layout")), layout_text(self.current_layout)
        layout = f"{now}, as saved" if saved == now else f"checkpoint {saved}   now {now}"
        out = [self.header(), f"  layout      {layout}"]
        if not self.flags_recorded:
            out.append(
                "  flags       not recorded in the checkpoint: only the model's shape flags are checked"
            )
        if self.changes:
            out.append(f"  flags that differ ({len(self.changes)}):")
            out += [f"    {c.line()}" for c in self.changes]
        elif self.flags_recorded:
            out.append("  flags       as saved")
        return out

    def refuse(self, flags: tuple[str, ...], why: str) -> None:
        """Mark the changes of ``flags`` refused, for ``why`` (a refusal raised by the caller)."""
        for c in self.changes:
            if c.flag in flags:
                c.refused, c.why = True, why

    def refusals(self) -> list[FlagChange]:
        return [c for c in self.changes if c.refused]

    def raise_if_refused(self, raised_elsewhere: tuple[str, ...] = ()) -> None:
        """Raises CheckpointError naming every refused flag but ``raised_elsewhere``, one per line (the
        shape flags in ``check_model_args``'s words, then the others), with what to do."""
        refused = [c for c in self.refusals() if c.flag not in raised_elsewhere]
        if not refused:
            return
        shape = {c.flag for c in refused if c.flag in self.shape_checks}
        if shape:
            try:
                check_model_args(self.common.get("args", {}), self.shape_checks, self.ckpt_dir, quiet)
                raise AssertionError(f"check_model_args passed the shape changes {sorted(shape)}")
            except CheckpointError as e:
                message = str(e)
            others = [c for c in refused if c.flag not in shape]
            if others:
                message += "\nand cannot resume with:\n" + "\n".join(f"  {c.line()}" for c in others)
            raise CheckpointError(message)
        raise CheckpointError(
            f"cannot resume from {self.ckpt_dir}:\n"
            + "\n".join(
                f"  {c.flag}: checkpoint {c.saved!r} vs current {c.current!r} ({c.why})" for c in refused
            )
            + "\nset these flags to the checkpoint's values, or pass --finetune to start a new run from its weights"
        )
