"""BlendedMegatronDatasetBuilder: from a GPTDatasetConfig to the train/valid/test datasets."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.errors import DataError
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.utils import Split, normalize

Blend = tuple[list[str], list[float] | None]


def get_size_per_split_per_dataset(
    weights: list[float], sizes: list[int | None], surplus: float
) -> tuple[list[list[int | None]], list[list[int | None]]]:
    """Per dataset and split: the samples it contributes (``ceil(S * w)``) and the samples it builds
    (that times ``1 + surplus``, rounded up)."""
    target = [[None if s is None else int(math.ceil(s * w)) for s in sizes] for w in weights]
    buffer = [[None if t is None else int(math.ceil(t * (1.0 + surplus))) for t in row] for row in target]
    return target, buffer


def _document_range(bookends: tuple[float, float] | None, num: int) -> tuple[int, int]:
    """The documents [beg, end) of ``num`` that split book-ends select (Megatron's rounding)."""
    if bookends is None:
        return 0, 0
    return int(round(bookends[0] * float(num))), int(round(bookends[1] * float(num)))


class BlendedMegatronDatasetBuilder:
    """Builds the datasets of every split with Megatron-Core semantics.

    Args:
        cls: a ``MegatronDataset`` subclass: ``GPTDataset``, ``MockGPTDataset`` (``GPTDataset`` with
            a config in mock mode builds it) or a user's own class.
        sizes: samples wanted for train, valid, test (None: one epoch / exhaustive).
        is_built_on_rank: whether this rank holds datasets (Megatron: TP rank 0 on the first or
            last pipeline stage). Every rank must still call ``build``.
        config: a ``BlendedMegatronDatasetConfig`` (``GPTDatasetConfig`` for the GPT classes).

    ``build()`` returns ``[train, valid, test]`` with None for splits that are not built: those not
    asked for and those ``empty_splits()`` names (no sample could be cut from them).
    """

    def __init__(
        self, cls: Any, sizes: list[int | None], is_built_on_rank: Callable[[], bool], config: Any
    ) -> None:
        if len(sizes) != 3:
            raise ValueError(f"sizes must list train, valid and test sample counts, got {sizes}")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        self._low_level: dict[str | None, Any] = {}
        self._empty: dict[Split, str] | None = None

        if config.mock and cls is GPTDataset:  # a custom class decides what its mock data is
            self.cls = MockGPTDataset

    def build(self) -> list[Any | None]:
        empty = self.empty_splits()  # on every rank, so that all of them raise alike
        if not self.is_built_on_rank():
            return [None, None, None]
        cfg = self.config
        if cfg.blend_per_split is None:
            matrix = [None if Split(i) in empty else b for i, b in enumerate(cfg.split_matrix)]
            if cfg.mock:
                return self._build_splits(None, matrix, self.sizes)
            return self._build_blend(cfg.blend, matrix, self.sizes)
        out: list[Any | None] = [None, None, None]
        for i in range(3):
            blend = cfg.blend_per_split[i]
            if blend is None or not blend[0] or Split(i) in empty:
                continue
            split: list[tuple[float, float] | None] = [None, None, None]
            split[i] = (0.0, 1.0)
            sizes: list[int | None] = [0, 0, 0]
            sizes[i] = self.sizes[i]
            out[i] = self._build_blend(blend, split, sizes)[i]
        return out

    def _build_blend(self, blend: Blend, split: list, sizes: list[int | None]) -> list[Any | None]:
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            return self._build_splits(prefixes[0], split, sizes)
        if weights is not None:
            if len(weights) != len(prefixes):
                raise ConfigError(
                    f"blend: {len(weights)} weights for {len(prefixes)} prefixes", params=("blend",)
                )
            weights = normalize(weights)
            target, buffer = get_size_per_split_per_dataset(
                weights, sizes, self.config.mid_level_dataset_surplus
            )
            per_dataset = [self._build_splits(p, split, buffer[d]) for d, p in enumerate(prefixes)]
        else:
            target = None
            per_dataset = [self._build_splits(p, split, [None, None, None]) for p in prefixes]
        out: list[Any | None] = [None, None, None]
        for i in range(3):
            if split[i] is None:
                continue
            children = [row[i] for row in per_dataset]
            if weights is not None and sizes[i] is not None:
                w, size = weights, sum(t[i] for t in target)
            else:
                w = [len(c) for c in children]
                if sum(w) == 0:
                    continue
                size = None if sizes[i] is None else int(min(sizes[i], sum(w)))
            out[i] = BlendedDataset(children, w, size, self.config)
            self._report(out[i], w, Split(i))
        return out

    def empty_splits(self) -> dict[Split, str]:
        """The asked-for splits from which not one sample can be cut, each with the reason, e.g.
        ``{Split.test: "--split 949,50,1 gives it 0 of 399 documents"}``.

        Decided from the data files alone (no index is built), so every rank, also one that builds
        no dataset, finds the same. A weighted blend is empty when any of its datasets is (its
        weights cannot be honoured); an unweighted one when all of them are.

        Raises:
            DataError: the train split is empty and train samples are asked for (``sizes[0]`` is
                not 0; None asks for one epoch).
        """
        if self._empty is not None:
            return self._empty
        self._empty = {}
        per_split = self.config.blend_per_split is not None
        for i, (blend, bookends, flag) in enumerate(self._split_sources()):
            if blend is None:
                continue
            prefixes, weights = blend
            name_paths = per_split or len(prefixes) > 1
            missing = [why for why in (self._shortfall(p, bookends, name_paths) for p in prefixes) if why]
            if missing and (weights is not None or len(missing) == len(prefixes)):
                self._empty[Split(i)] = f"{flag} gives it {'; '.join(missing)}"
        if Split.train in self._empty and self.sizes[0] != 0:
            fix = (
                "give --train-data-path more tokens"
                if self.config.blend_per_split is not None
                else "give it a share, e.g. --split 969,30,1"
            )
            raise DataError(f"train split is empty ({self._empty[Split.train]}); {fix}")
        return self._empty

    def _split_sources(self) -> list[tuple[Any, tuple[float, float] | None, str]]:
        """Per split: the blend it draws from (mock data: ``([None], None)``), its document range
        and the flag that chose both."""
        cfg = self.config
        if cfg.blend_per_split is not None:
            return [
                (b if b is not None and b[0] else None, (0.0, 1.0), f"--{name}-data-path")
                for b, name in zip(cfg.blend_per_split, ("train", "valid", "test"))
            ]
        blend = ([None], None) if cfg.mock else cfg.blend
        return [(blend, bookends, f"--split {cfg.split.replace(' ', '')}") for bookends in cfg.split_matrix]

    def _shortfall(
        self, path: str | None, bookends: tuple[float, float] | None, name_path: bool
    ) -> str | None:
        """Why the documents ``bookends`` selects from ``path`` hold no sample (None: they hold one)."""
        low = self._low_level_dataset(path)
        num = self.cls.numel_low_level_dataset(low)
        beg, end = _document_range(bookends, num)
        what = f"{end - beg} of {num} documents" + (f" of {path or 'mock data'}" if name_path else "")
        if end == beg:
            return what
        lengths = getattr(low, "sequence_lengths", None)
        if lengths is None:  # not token documents (a custom dataset): any document is a sample
            return None
        need = self.config.sequence_length + int(getattr(self.config, "add_extra_token_to_sequence", True))
        tokens = int(np.asarray(lengths[beg:end]).sum(dtype=np.int64))
        if tokens < need:
            return f"{what}, {tokens} tokens, fewer than one sample of {need}"
        return None

    def _low_level_dataset(self, path: str | None) -> Any:
        if path not in self._low_level:
            self._low_level[path] = self.cls.build_low_level_dataset(path, self.config)
        return self._low_level[path]

    def _build_splits(self, path: str | None, split: list, sizes: list[int | None]) -> list[Any | None]:
        low = self._low_level_dataset(path)
        num = self.cls.numel_low_level_dataset(low)
        out: list[Any | None] = [None, None, None]
        for i in range(3):
            if split[i] is None:
                continue
            beg, end = _document_range(split[i], num)
            indices = np.arange(beg, end, dtype=np.int32)
            out[i] = self.cls(low, path, indices, sizes[i], Split(i), self.config)
        return out

    def _report(self, blended: BlendedDataset, requested: list[float], split: Split) -> None:
        total = float(sum(requested))
        realised = blended.realised_weights()
        self.config.emit(
            f" > {split.name} blend of {len(blended)} samples from {len(blended.datasets)} datasets:"
        )
        for d, child in enumerate(blended.datasets):
            per_epoch = max(len(child) // max(getattr(child, "num_epochs", 1), 1), 1)
            drawn = int(round(realised[d] * len(blended)))
            self.config.emit(
                f"   {child.dataset_path}: requested weight {requested[d] / total:.4f}, realised "
                f"{realised[d]:.4f}, {drawn} samples = {drawn / per_epoch:.3f} epochs"
            )
