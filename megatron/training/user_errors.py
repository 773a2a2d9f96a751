"""User errors as the command line reports them.

The library names each parameter as its config dataclass spells it (``tensor_model_parallel_size``)
and lists those names in ``ConfigError.params``; :func:`flag_message` rewrites them to the flags of
``pretrain_gpt.py`` (``--tensor-model-parallel-size``), so that library users read field names and
command-line users read flags. A field's flag comes from its metadata (``config_utils.doc(flag=...)``,
the parser's own rule); a Megatron-LM flag that is not one of our fields from the Megatron-LM dest
table (``megatron_flag_dests``); the dataset config's parameters, which the application fills from
differently named flags, from :data:`DATASET_FLAGS` (and the LR scheduler's from
:data:`SCHEDULER_FLAGS`); a field that only a Megatron-LM alias sets
(``--disable-bias-linear``) from :data:`ALIAS_FLAGS`.
"""

from __future__ import annotations

import dataclasses

from megatron.core.config_utils import ConfigError, flag_default
from megatron.core.datasets.errors import DataError
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.training.config_sections import SECTIONS, flag_name
from megatron.training.megatron_flag_dests import default_of, dest_of
from megatron.training.megatron_flag_table import FOREIGN
from megatron.training.param_flags import rewrite_params

# The errors that are the user's to fix: reported as one line (exit code 2). Anything else is a bug.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError, DataError)

# GPTDatasetConfig's parameters -> the flag the application fills each from (training/datasets/provider.py).
DATASET_FLAGS: dict[str, str] = {
    "sequence_length": "--seq-length",
    "path_to_cache": "--data-cache-path",
    "blend": "--data-path",
    "blend_per_split": "--train/valid/test-data-path",
    "split": "--split",
    "random_seed": "--seed",
    "mid_level_dataset_surplus": "--mid-level-dataset-surplus",
}

# OptimizerParamScheduler's parameters -> the flags the application derives each from (loop_utils).
SCHEDULER_FLAGS: dict[str, str] = {
    "max_lr": "--lr",
    "init_lr": "--lr-warmup-init",
    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction",
    "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples",
    "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay",
    "wd_incr_steps": "--train-iters/--train-samples",
    "wd_incr_style": "--weight-decay-incr-style",
    "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
}

# Fields without a flag of their own that one of the parser's ALIASES switches: field -> (flag, value it sets).
ALIAS_FLAGS: dict[str, tuple[str, bool]] = {
    "add_bias_linear": ("--disable-bias-linear", False),
    "share_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", False),
}


def flag_of(param: str) -> tuple[str, bool | None] | None:
    """The command-line flag of a config parameter and the value it sets when it is a switch (None
    for a flag that takes a value), or None when no flag sets the parameter."""
    for _, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if f.name != param:
                continue
            flag = flag_name(f)
            if flag is None:
                continue
            switch = f.type in ("bool", bool)
            return flag, (not flag_default(f) if switch else None)
    if param in ALIAS_FLAGS:
        return ALIAS_FLAGS[param]
    if param in DATASET_FLAGS:
        return DATASET_FLAGS[param], None
    if param in SCHEDULER_FLAGS:
        return SCHEDULER_FLAGS[param], None
    for flag, entry in FOREIGN.items():
        if dest_of(flag) == param:
            return flag, (default_of(param) is not True if entry.nargs == 0 else None)
    return None


def flag_message(error: BaseException) -> str:
    """The error's message with each parameter it names (``ConfigError.params``) written as its
    command-line flag; a parameter without a flag, and any other error, reads as raised."""
    return rewrite_params(str(error), getattr(error, "params", ()), flag_of)


def name_flags(error: BaseException) -> None:
    """Rewrite ``error``'s message in place to name flags (:func:`flag_message`), for an error that
    the application's own API raises on (``arguments.parse_run_config``); its ``params`` are emptied,
    so the message is not rewritten twice."""
    if getattr(error, "params", ()):
        error.args = (flag_message(error),)
        error.params = ()  # type: ignore[attr-defined]
