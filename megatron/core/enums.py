"""Megatron-Core's top-level enums: the model type and the FP8 / FP4 recipe names."""

from __future__ import annotations

import enum


class ModelType(enum.Enum):
    """The model family a schedule runs; decoder-only GPT models are ``encoder_or_decoder``."""

    encoder_or_decoder = 1


class Fp8Recipe(str, enum.Enum):
    """FP8 scaling recipes by name; this package runs ``tensorwise`` and ``delayed``
    (``TransformerConfig.fp8_recipe``)."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """FP4 recipes by name (FP4 is not built here; ``TransformerConfig.fp4`` is refused)."""

    nvfp4 = "nvfp4"
    custom = "custom"
