"""The configs the command line is generated from, in ``--help`` order, and each field's flag.

Kept apart from the parser (``arguments``) so that the error reporting (``user_errors``), which the
parser uses, can map a config field to its flag without importing the parser.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.config_utils import doc, flag_default
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)


@dataclass
class ModelImplConfig:
    """Implementation choices that are not part of the model's mathematics."""

    transformer_impl: str = doc(
        "local",
        "Layer implementation. Only 'local' (this package's own modules "
        "and SDPA attention) is supported; a Transformer Engine path is not shipped.",
        choices=("local", "transformer_engine"),
    )
    torch_compile: str = doc(
        "auto",
        "torch.compile each transformer layer (and the fused cross entropy's elementwise steps). "
        "'auto' and 'on': compiled on CUDA, at any tensor-parallel size; 'off': eager everywhere. "
        "Has no effect on CPU. Compilation adds about a minute at start-up.",
        choices=("auto", "on", "off"),
    )
    disable_bf16_reduced_precision_matmul: bool = doc(
        False,
        "Make cuBLAS accumulate bf16 GEMMs without reduced-precision reductions "
        "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False); slower, closer to fp32. "
        "Set once at start-up; no effect on the CPU.",
    )


# (section title, config class) in --help order.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", TransformerConfig),
    ("implementation", ModelImplConfig),
    ("data-parallel gradient reduction", DistributedDataParallelConfig),
    ("training", TrainingConfig),
    ("learning-rate and weight-decay schedule", SchedulerConfig),
    ("optimizer and mixed precision", OptimizerConfig),
    ("data", DataConfig),
    ("tokenizer", TokenizerConfig),
    ("checkpointing", CheckpointConfig),
    ("logging and evaluation", LoggerConfig),
)


def flag_name(f: dataclasses.Field) -> str | None:
    """The command-line flag of a config field (None: not a flag): its metadata's spelling, else
    ``--field-name``, or ``--no-field-name`` for a boolean that defaults to True."""
    flag = f.metadata.get("flag", "")
    if flag is None:
        return None
    if flag:
        return flag
    if f.type in ("bool", bool) and flag_default(f) is True:
        return "--no-" + f.name.replace("_", "-")
    return "--" + f.name.replace("_", "-")
