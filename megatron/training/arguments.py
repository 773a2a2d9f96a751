"""Megatron-LM's ``megatron.training.arguments``: the run's configs from the command line
(``parse_run_config``, the generated parser: ``run_config``) and Megatron-LM's two-step
``parse_args`` / ``validate_args`` (``megatron_args``), under the names Megatron-LM users import.
"""

from megatron.training.megatron_args import parse_args, validate_args
from megatron.training.run_config import (
    ALIASES,
    REQUIRED,
    SECTIONS,
    SPELLINGS,
    ModelImplConfig,
    RunConfig,
    attach_negative_values,
    build_parser,
    configs_from_namespace,
    default_text,
    flag_list,
    flag_name,
    format_arguments,
    parse_namespace,
    parse_run_config,
    run_config_from_values,
)

__all__ = [
    "ALIASES",
    "REQUIRED",
    "SECTIONS",
    "SPELLINGS",
    "ModelImplConfig",
    "RunConfig",
    "attach_negative_values",
    "build_parser",
    "configs_from_namespace",
    "default_text",
    "flag_list",
    "flag_name",
    "format_arguments",
    "parse_args",
    "parse_namespace",
    "parse_run_config",
    "run_config_from_values",
    "validate_args",
]
