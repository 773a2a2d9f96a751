"""BlendedMegatronDatasetConfig: what BlendedMegatronDatasetBuilder needs of any dataset class.

The fields, their order and defaults are Megatron-Core 0.19.2's; ``cache_wait_timeout_s`` and
``log`` are ours and come last. Dataset-specific configs (``GPTDatasetConfig``) subclass it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    normalize,
    parse_and_normalize_split,
)

__all__ = [
    "BlendedMegatronDatasetConfig",
    "convert_split_vector_to_split_matrix",
    "normalize",
    "parse_and_normalize_split",
]

logger = logging.getLogger(__name__)

Blend = tuple[list[str], list[float] | None]


@dataclass
class BlendedMegatronDatasetConfig:
    """Where the data comes from, how it is split, and where the index caches live.

    Mock mode (``mock``) is on when neither ``blend`` nor ``blend_per_split`` names a dataset.

    Raises (from ``__post_init__``):
        ConfigError: naming the field, for a non-positive ``sequence_length``, ``blend`` together
            with ``blend_per_split`` (or ``split`` with ``blend_per_split``), a ``blend_per_split``
            without 3 entries, weights not one per prefix, ``blend`` without ``split``, or
            ``fast_cache_load`` / ``defer_npy_index_mmap`` without ``path_to_cache``.
    """

    random_seed: int
    """Seed of the document and sample shuffles (``--seed``)."""
    sequence_length: int
    """Tokens per sample, S (``--seq-length``)."""
    blend: Blend | None = None
    """(prefixes, weights or None) split by ``split`` (``--data-path``); None weights: in
    proportion to the datasets' sizes."""
    blend_per_split: list[Blend | None] | None = None
    """One blend (or None) per split train/valid/test (``--train-data-path`` ...); excludes ``blend``
    and ``split``. All three None means mock mode."""
    multiple_validation_sets: bool | None = None
    """Read by the training loop (one validation set per dataset); no effect on building."""
    full_validation: bool | None = None
    """Read by the training loop (a full validation epoch each time); no effect on building."""
    split: str | None = None
    """Proportions of ``blend``, e.g. ``"969,30,1"``; mock mode defaults to ``"1,1,1"``."""
    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    """Book-ends of each split, derived from ``split``."""
    num_dataset_builder_threads: int = 1
    """Accepted; index building is vectorised in one thread."""
    path_to_cache: str | None = None
    """Index cache directory (``--data-cache-path``); default ``<prefix>/cache/<class>_indices``."""
    mmap_bin_files: bool = True
    """Memory-map ``.bin`` files (``--no-mmap-bin-files`` reads with plain I/O)."""
    mock: bool = field(init=False, default=False)
    """Derived: no dataset is named, so the mock dataset class is used."""
    tokenizer: Any = None
    """A tokenizer with ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers``."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds, so blending never runs short."""
    allow_ambiguous_pad_tokens: bool | None = False
    """When the tokenizer's pad id equals another special id (eod/eos), still mask it out of the
    loss (True); by default such a pad id is not treated as padding. Both warn."""
    fast_cache_load: bool = False
    """Accepted (needs ``path_to_cache``, excludes ``blend``); the caches are checked as usual."""
    defer_npy_index_mmap: bool = False
    """Accepted (needs ``path_to_cache``); the indices are loaded at construction as usual."""
    cache_wait_timeout_s: float = 4 * 3600.0
    """How long non-zero ranks poll for rank 0's index cache before giving up."""
    log: Callable[[str], Any] | None = field(default=None, repr=False)
    """Where progress lines go (default: the module logger)."""

    def __post_init__(self) -> None:
        if self.sequence_length is None or self.sequence_length < 1:
            raise ConfigError(
                f"sequence_length must be >= 1, got {self.sequence_length}", params=("sequence_length",)
            )
        for name in ("fast_cache_load", "defer_npy_index_mmap"):
            if getattr(self, name) and self.path_to_cache is None:
                raise ConfigError(f"{name} needs path_to_cache", params=(name, "path_to_cache"))
        if self.fast_cache_load and self.blend is not None:
            raise ConfigError(
                "fast_cache_load cannot be used with blend; give blend_per_split",
                params=("fast_cache_load", "blend"),
            )
        if self.blend_per_split is not None and any(self.blend_per_split):
            self._check_blend_per_split()
        elif self.blend is not None:
            _check_weights(self.blend, "blend")
            if self.split is None:
                raise ConfigError("split (e.g. 969,30,1) is required with blend", params=("split", "blend"))
        else:
            self.blend_per_split = None
            self.mock = True
            if self.split is None:
                self.split = "1,1,1"
        if self.blend_per_split is None:
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))

    def _check_blend_per_split(self) -> None:
        assert self.blend_per_split is not None
        if self.blend is not None:
            raise ConfigError(
                "blend and blend_per_split are incompatible: give one of them, not both",
                params=("blend", "blend_per_split"),
            )
        if self.split is not None:
            raise ConfigError(
                "split and blend_per_split are incompatible: split applies to blend only",
                params=("split", "blend_per_split", "blend"),
            )
        if len(self.blend_per_split) != len(Split):
            raise ConfigError(
                f"blend_per_split needs {len(Split)} entries (or None) for train, valid, test, "
                f"got {len(self.blend_per_split)}",
                params=("blend_per_split",),
            )
        for s in Split:
            b = self.blend_per_split[s.value]
            if b is not None:
                _check_weights(b, f"blend_per_split[{s.value}] ({s.name})", "blend_per_split")

    def emit(self, msg: str) -> None:
        (self.log or logger.info)(msg)


def _check_weights(blend: Blend, name: str, param: str = "blend") -> None:
    prefixes, weights = blend
    if weights is not None and len(weights) != len(prefixes):
        raise ConfigError(
            f"{name}: {len(weights)} weights for {len(prefixes)} prefixes; give one weight per "
            "prefix, or None",
            params=(param,),
        )
