"""``--use-checkpoint-args`` (Megatron-LM's flag): the model's architecture from the ``--load``
checkpoint, for every architecture flag not given on the command line.

Read before the configs are built: one rank-local read of the checkpoint's common values (the
tracker's checkpoint, or ``--ckpt-step``'s; ``--load`` may also name one ``iter_XXXXXXX``). Taken from
its ``args["config"]`` (what a training run saves, and the Hugging Face importer's architecture-only
config): the ``ARCHITECTURE`` fields of the model, training and tokenizer sections, and the padded
vocabulary size. A flag given on the command line keeps its value; where it differs from the
checkpoint, the load's shape check refuses it as without ``--use-checkpoint-args``. The tokenizer
fields are one unit: given any tokenizer flag, none is taken.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.config_utils import ConfigError, flag_default
from megatron.core.dist_checkpointing import CheckpointError
from megatron.training import checkpoint_dirs
from megatron.training.config_sections import SECTIONS, flag_name

# The config fields that fix a model's architecture, by section: what --use-checkpoint-args takes, and
# (the "model" part) what a Hugging Face import records and the logits check builds the model from.
ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "model": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "normalization",
        "layernorm_epsilon",
        "apply_layernorm_1p",
        "activation",
        "add_bias_linear",
        "add_qkv_bias",
        "bias_gelu_fusion",
        "bias_activation_fusion",
        "qk_layernorm",
        "softmax_scale",
        "position_embedding_type",
        "rotary_base",
        "rotary_percent",
        "rotary_seq_len_interpolation_factor",
        "rope_scaling",
        "rope_scaling_factor",
        "share_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_layer_freq",
        "moe_router_topk",
        "moe_router_score_function",
        "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_router_enable_expert_bias",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
    ),
    "training": ("max_position_embeddings", "seq_length", "make_vocab_size_divisible_by"),
    "tokenizer": (
        "tokenizer_type",
        "vocab_file",
        "merge_file",
        "tokenizer_model",
        "vocab_size",
        "null_tokenizer_eod_id",
        "tiktoken_pattern",
        "tiktoken_num_special_tokens",
    ),
}
FLAG = "--use-checkpoint-args"


def checkpoint_dir_of(load: str | None, ckpt_step: int | None) -> str:
    """The checkpoint directory ``--load`` (and ``--ckpt-step``) name.

    Raises:
        ConfigError: no ``--load``, or no complete checkpoint there (naming both flags).
    """
    if not load:
        raise ConfigError(f"{FLAG} reads the model's flags from the --load checkpoint: pass --load DIR")
    parent, step = checkpoint_dirs.split_iteration_dir(load)
    step = step if step is not None else ckpt_step
    if step is None:
        try:
            step = checkpoint_dirs.read_tracker(parent)
        except CheckpointError as e:
            raise ConfigError(f"{FLAG}: {e}") from None
    if step is None:
        raise ConfigError(
            f"{FLAG}: --load {load} holds no checkpoint (no {checkpoint_dirs.TRACKER_FILENAME}); pass the "
            "directory of a run's checkpoints or one iter_XXXXXXX, or drop --use-checkpoint-args"
        )
    ckpt_dir = checkpoint_dirs.resolve(checkpoint_dirs.iteration_dir(parent, step))
    if not dist_checkpointing.is_complete_checkpoint(ckpt_dir):
        raise ConfigError(
            f"{FLAG}: --load {load} has no complete checkpoint of iteration {step} ({ckpt_dir} has no "
            f"{dist_checkpointing.METADATA_FILE}); pass --ckpt-step N of a complete one"
        )
    return ckpt_dir


def saved_values(args: dict) -> dict[str, Any]:
    """The ``ARCHITECTURE`` values (by field) a checkpoint's ``args`` records, and its padded vocab size."""
    config = args.get("config") if isinstance(args.get("config"), dict) else {}
    out: dict[str, Any] = {}
    for section, fields in ARCHITECTURE.items():
        saved = config.get(section) or {}
        out.update({f: saved[f] for f in fields if f in saved})
    padded = (config.get("tokenizer") or {}).get("padded_vocab_size") or args.get("padded_vocab_size")
    if padded:
        out["padded_vocab_size"] = padded
    return out


def fill_from_checkpoint(values: dict, load: str | None, ckpt_step: int | None) -> list[str]:
    """Put into ``values`` (flag values by field, aliases applied) the checkpoint's architecture
    fields that are not in it; return the note line listing what was taken.

    Raises:
        ConfigError: no ``--load`` or no checkpoint there; the checkpoint records no flags.
    """
    ckpt_dir = checkpoint_dir_of(load, ckpt_step)
    common = dist_checkpointing.load_common_state(ckpt_dir)
    args = common.get("args")
    saved = saved_values(args) if isinstance(args, dict) else {}
    if not saved:
        raise ConfigError(
            f"{FLAG}: {ckpt_dir} does not record its model's flags; pass them on the command line "
            "instead of --use-checkpoint-args"
        )
    tokenizer = set(ARCHITECTURE["tokenizer"])
    if tokenizer & set(values):
        saved = {k: v for k, v in saved.items() if k not in tokenizer}
    taken = {k: v for k, v in saved.items() if k not in values and v is not None}
    values.update(taken)
    if not taken:
        return [f"note: {FLAG}: every model flag is given; nothing taken from {ckpt_dir}"]
    shown = " ".join(_spelled(taken))
    return [
        f"note: {FLAG}: {len(taken)} model flags taken from {os.path.normpath(ckpt_dir)}: "
        f"{shown or 'all at their defaults'}{' (the rest at their defaults)' if shown else ''}"
    ]


# How the flagless architecture fields are spelled on the command line: field -> {value: flag}.
_ALIAS_SPELLING: dict[str, dict[Any, str]] = {
    "activation": {"swiglu": "--swiglu"},
    "add_bias_linear": {False: "--disable-bias-linear"},
    "share_embeddings_and_output_weights": {False: "--untie-embeddings-and-output-weights"},
}


def _spelled(taken: dict[str, Any]) -> list[str]:
    """The command-line spelling of the values in ``taken`` that differ from their flag's default."""
    fields: dict[str, dataclasses.Field] = {}
    for _, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, f)
    out = []
    for name, value in taken.items():
        if name in _ALIAS_SPELLING:
            if value in _ALIAS_SPELLING[name]:
                out.append(_ALIAS_SPELLING[name][value])
            continue
        f = fields.get(name)
        flag = flag_name(f) if f is not None else None
        if flag is None or value == f.metadata.get("app_default", flag_default(f)):
            continue
        if isinstance(value, bool):
            out.append(flag)  # a switch: the value differs from the default only when given
        else:
            out.append(f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return out
