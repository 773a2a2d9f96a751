"""BlendedMegatronDatasetBuilder: from a GPTDatasetConfig to the train/valid/test datasets."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.utils import Split, normalize

Blend = tuple[list[str], list[float] | None]


def get_size_per_split_per_dataset(weights: list[float], sizes: list[int | None],
                                   surplus: float) -> tuple[list[list[int | None]], list[list[int | None]]]:
    """Per dataset and split: the samples it contributes (``ceil(S * w)``) and the samples it builds
    (that times ``1 + surplus``, rounded up)."""
    target = [[None if s is None else int(math.ceil(s * w)) for s in sizes] for w in weights]
    buffer = [[None if t is None else int(math.ceil(t * (1.0 + surplus))) for t in row] for row in target]
    return target, buffer


class BlendedMegatronDatasetBuilder:
    """Builds the datasets of every split with Megatron-Core semantics.

    Args:
        cls: ``GPTDataset`` or ``MockGPTDataset`` (mock mode is forced when the config has no blend).
        sizes: samples wanted for train, valid, test (None: one epoch / exhaustive).
        is_built_on_rank: whether this rank holds datasets (Megatron: TP rank 0 on the first or
            last pipeline stage). Every rank must still call ``build``.
        config: a ``GPTDatasetConfig``.

    ``build()`` returns ``[train, valid, test]`` with None for splits that are not built.
    """

    def __init__(self, cls: Any, sizes: list[int | None], is_built_on_rank: Callable[[], bool], config: Any) -> None:
        if len(sizes) != 3:
            raise ValueError(f"sizes must list train, valid and test sample counts, got {sizes}")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if config.mock and not getattr(cls, "__name__", "").startswith("Mock"):
            from megatron.core.datasets.gpt_dataset import MockGPTDataset

            self.cls = MockGPTDataset

    def build(self) -> list[Any | None]:
        if not self.is_built_on_rank():
            return [None, None, None]
        cfg = self.config
        if cfg.mock:
            return self._build_splits(None, cfg.split_matrix, self.sizes)
        if cfg.blend is not None:
            return self._build_blend(cfg.blend, cfg.split_matrix, self.sizes)
        out: list[Any | None] = [None, None, None]
        for i in range(3):
            blend = cfg.blend_per_split[i]
            if blend is None or not blend[0]:
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
                raise ValueError(f"--data-path: {len(weights)} weights for {len(prefixes)} prefixes")
            weights = normalize(weights)
            target, buffer = get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
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

    def _build_splits(self, path: str | None, split: list, sizes: list[int | None]) -> list[Any | None]:
        low = self.cls.build_low_level_dataset(path, self.config)
        num = self.cls.numel_low_level_dataset(low)
        out: list[Any | None] = [None, None, None]
        for i in range(3):
            if split[i] is None:
                continue
            beg, end = int(round(split[i][0] * float(num))), int(round(split[i][1] * float(num)))
            indices = np.arange(beg, end, dtype=np.int32)
            out[i] = self.cls(low, path, indices, sizes[i], Split(i), self.config)
        return out

    def _report(self, blended: BlendedDataset, requested: list[float], split: Split) -> None:
        total = float(sum(requested))
        realised = blended.realised_weights()
        self.config.emit(f" > {split.name} blend of {len(blended)} samples from {len(blended.datasets)} datasets:")
        for d, child in enumerate(blended.datasets):
            per_epoch = max(len(child) // max(getattr(child, "num_epochs", 1), 1), 1)
            drawn = int(round(realised[d] * len(blended)))
            self.config.emit(f"   {child.dataset_path}: requested weight {requested[d] / total:.4f}, realised "
                             f"{realised[d]:.4f}, {drawn} samples = {drawn / per_epoch:.3f} epochs")
