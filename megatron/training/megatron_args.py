"""Megatron-LM's two-step argument contract: ``parse_args`` reads ``sys.argv`` into an
``argparse.Namespace`` without judging combinations, ``validate_args`` checks it and fills the values
derived from other flags.

The namespace carries every flag our parser implements under Megatron-LM's dest name, with its
default when not given (flags that are required here are None until given, as in Megatron-LM);
where our config field is named differently, both names are set (``MIRRORS``). ``validate_args``
builds the run's configs from the namespace with the same code as ``parse_run_config`` (one set of
checks), so the two paths accept and refuse the same command lines.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.training import run_config
from megatron.training.megatron_flag_dests import default_of, dest_of
from megatron.training.megatron_flag_table import FOREIGN
from megatron.training.megatron_flags import GIVEN
from megatron.training.validation import world_size_from_env

# The attributes where parse_args keeps what validate_args needs and Megatron-LM has no name for.
GIVEN_DESTS = "_megatron_given_dests"
NOTES = "_megatron_notes"


@dataclass(frozen=True)
class Mirror:
    """A Megatron-LM dest whose value is a function of one of our dests.

    Attributes:
        megatron: Megatron-LM's dest name (``args.<megatron>``).
        ours: our parser's dest (a config field or an alias switch).
        to_megatron: our value -> Megatron's.
        to_ours: Megatron's value -> ours (used when a user set ``args.<megatron>`` before validating).
    """

    megatron: str
    ours: str
    to_megatron: Callable[[Any], Any] = lambda v: v
    to_ours: Callable[[Any], Any] = lambda v: v


def _negated_switch(megatron: str, ours: str) -> Mirror:
    """``--no-save-optim``: Megatron-LM stores True (default None); we store ``save_optim=False``."""
    return Mirror(megatron, ours, to_megatron=lambda v: True if v is False else None, to_ours=lambda m: not m)


def _not(megatron: str, ours: str) -> Mirror:
    return Mirror(megatron, ours, to_megatron=lambda v: not v, to_ours=lambda m: not m)


MIRRORS: tuple[Mirror, ...] = (
    Mirror("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
    Mirror("microbatch_group_size_per_vp_stage", "microbatch_group_size_per_virtual_pipeline_stage"),
    Mirror("num_virtual_stages_per_pipeline_rank", "virtual_pipeline_model_parallel_size"),
    Mirror("fp8", "fp8_format"),
    Mirror("ddp_bucket_size", "bucket_size"),
    Mirror("ddp_average_in_collective", "average_in_collective"),
    Mirror("use_rope_scaling", "rope_scaling"),
    Mirror("num_experts", "num_moe_experts"),
    _negated_switch("no_save_optim", "save_optim"),
    _negated_switch("no_save_rng", "save_rng"),
    _negated_switch("no_load_optim", "load_optim"),
    _negated_switch("no_load_rng", "load_rng"),
    _not("add_bias_linear", "disable_bias_linear"),
    _not("add_position_embedding", "no_position_embedding"),
)


def _dest_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Every dest of ``parser`` (ours and an ``extra_args_provider``'s) with its default."""
    fields = run_config._defaults()
    out: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in (GIVEN, "help", "help_megatron"):
            continue
        if action.default is argparse.SUPPRESS:
            out[action.dest] = None if action.dest in run_config.REQUIRED else fields.get(action.dest)
        else:
            out[action.dest] = action.default
    return out


@functools.lru_cache(maxsize=1)
def _our_defaults() -> dict[str, Any]:
    """``_dest_defaults`` of our own parser, built once (read-only: copy before storing a value)."""
    return _dest_defaults(run_config.build_parser())


def parse_args(
    extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False
) -> argparse.Namespace:
    """Parse ``sys.argv[1:]`` as Megatron-LM's ``parse_args`` does: no cross-flag checks, no derived values.

    Args:
        extra_args_provider: ``f(parser) -> parser`` adding the caller's own flags (their dests and
            defaults land in the namespace too).
        ignore_unknown_args: flags unknown to us and to Megatron-LM are dropped instead of reported.

    Returns:
        The namespace: every flag's dest with the given value or its default, plus ``rank`` and
        ``world_size`` from the launcher's environment (``--world-size`` wins where given).

    Flags that cannot be taken (unknown, Megatron-LM flags refused here, bad values or choices) are
    reported together, one line each, and exit with code 2, as ``pretrain_gpt.py`` does.
    """
    parser = run_config.build_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    foreign: list = []
    values, notes = run_config.parse_namespace(
        sys.argv[1:], parser=parser, ignore_unknown=ignore_unknown_args, foreign_given=foreign
    )
    merged = {**copy.deepcopy(_dest_defaults(parser)), **values}
    args = argparse.Namespace(**merged)
    for m in MIRRORS:
        setattr(args, m.megatron, m.to_megatron(merged.get(m.ours)))
    _set_foreign(args, foreign)
    args.rank = int(os.environ.get("RANK", "0"))
    if values.get("world_size") is None:
        args.world_size = world_size_from_env()
    args._is_global_batch_size_explicitly_specified = values.get("global_batch_size") is not None
    setattr(args, GIVEN_DESTS, sorted(values))
    setattr(args, NOTES, notes)
    return args


def _set_foreign(args: argparse.Namespace, given: list) -> None:
    """Megatron-LM's dests of the flags that are not ours (``megatron_flag_dests``): its default, or
    the value given (converted to the default's type; a switch stores the opposite of its default)."""

    for flag in FOREIGN:
        dest = dest_of(flag)
        if not hasattr(args, dest):
            setattr(args, dest, default_of(dest))  # default_of returns a fresh list
    ours = {m.megatron for m in MIRRORS} | set(_our_defaults())
    for entry, value in given:
        dest = dest_of(entry.flag)
        if dest in ours:
            continue
        default = default_of(dest)
        if entry.nargs == 0:
            setattr(args, dest, not default if isinstance(default, bool) else True)
        else:
            setattr(args, dest, _convert(value, default))


def _convert(value: Any, default: Any) -> Any:
    """A given value as Megatron-LM's parser would type it, judged by the default's type."""
    if isinstance(value, list):
        sample = default[0] if isinstance(default, list) and default else None
        return [_convert(v, sample) for v in value]
    for typ in (int, float):
        if isinstance(default, typ) and not isinstance(default, bool):
            try:
                return typ(value)
            except (TypeError, ValueError):
                return value
    return value


def _values_for_configs(args: argparse.Namespace) -> dict[str, Any]:
    """Our dests' values as ``configs_from_namespace`` takes them: the ones given on the command line
    and any a caller changed on ``args`` since (including through a Megatron-LM name)."""
    defaults = _our_defaults()
    given = set(getattr(args, GIVEN_DESTS, ()))
    values: dict[str, Any] = {}
    for dest, default in defaults.items():
        if dest == "world_size" and dest not in given:
            continue  # the namespace's world size is the launcher's; validate_args passes it on
        value = getattr(args, dest, default)
        if dest in given or value != default:
            values[dest] = value
    for m in MIRRORS:
        if not hasattr(args, m.megatron):
            continue
        ours = getattr(args, m.ours, defaults.get(m.ours))
        if getattr(args, m.megatron) != m.to_megatron(ours):
            values[m.ours] = m.to_ours(getattr(args, m.megatron))
    return values


def _fill_derived(args: argparse.Namespace, cfg: run_config.RunConfig, world_size: int) -> None:
    """Write the configs' resolved values back under their dests, and Megatron-LM's derived values."""
    dests = set(_our_defaults())
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for field in dataclasses.fields(section):
            if field.name in dests and field.name != "world_size":
                setattr(args, field.name, getattr(section, field.name))
    for m in MIRRORS:
        setattr(args, m.megatron, m.to_megatron(getattr(args, m.ours, None)))
    model, training = cfg.model, cfg.training
    cp = getattr(args, "context_parallel_size", None) or 1
    args.world_size = world_size
    args.data_parallel_size = world_size // (
        model.tensor_model_parallel_size * model.pipeline_model_parallel_size * cp
    )
    args.transformer_pipeline_model_parallel_size = model.pipeline_model_parallel_size
    args.params_dtype = model.params_dtype
    args.ffn_hidden_size, args.kv_channels = model.ffn_hidden_size, model.kv_channels
    args.global_batch_size = training.global_batch_size
    args.encoder_num_layers, args.encoder_seq_length = model.num_layers, training.seq_length
    for name, value in (
        ("eval_micro_batch_size", training.micro_batch_size),
        ("eval_global_batch_size", training.global_batch_size),
        ("start_weight_decay", cfg.optimizer.weight_decay),
        ("end_weight_decay", cfg.optimizer.weight_decay),
    ):
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args.variable_seq_lengths = False
    args.run_config = cfg


def validate_args(args: argparse.Namespace, defaults: dict | None = None) -> argparse.Namespace:
    """Check ``args`` and fill its derived values, as Megatron-LM's ``validate_args`` does.

    Args:
        args: a namespace from ``parse_args`` (a caller may have changed attributes since).
        defaults: ``{dest: value}`` applied to dests that are None (not given), as Megatron-LM does.

    Returns:
        ``args`` itself, with the resolved values (``ffn_hidden_size``, ``kv_channels``,
        ``global_batch_size``, ``sequence_parallel`` off at tp 1, ...), Megatron-LM's derived ones
        (``data_parallel_size``, ``params_dtype``, ``encoder_seq_length``, ``consumed_train_samples``
        ...) and ``run_config``, the typed configs this package runs from.

    Raises:
        ValueError: a missing required flag or an invalid combination, naming the flag and a valid value.
    """
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    world_size = int(getattr(args, "world_size", None) or world_size_from_env())
    cfg = run_config.run_config_from_values(_values_for_configs(args), getattr(args, NOTES, []), world_size)
    _fill_derived(args, cfg, world_size)
    if getattr(args, "rank", 0) == 0 and cfg.notes:
        print("\n".join(cfg.notes), flush=True)
    return args
