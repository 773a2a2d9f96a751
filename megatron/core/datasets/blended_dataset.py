"""BlendedDataset: samples drawn from several datasets in given proportions."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron.core.config_utils import ConfigError
from megatron.core.datasets import helpers
from megatron.core.datasets.utils import (
    build_or_wait,
    cache_complete,
    cache_paths,
    dumps_description,
    load_cache,
)

BLEND_SUFFIXES = ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")


class BlendedDataset(Dataset):
    """Interleaves ``datasets`` by the deterministic greedy rule of ``helpers.build_blending_indices``.

    Args:
        datasets: the child datasets (GPTDataset or anything indexable with a length).
        weights: their (normalised or not) proportions.
        size: samples of the blend; None draws every sample of every child exactly once.
        config: the dataset config (``path_to_cache`` enables the blend cache).

    Raises:
        ConfigError: a child is asked for more samples than it holds (raise
        ``mid_level_dataset_surplus``).

    ``self[i]`` is the child's sample dict plus ``dataset_id`` (int64 scalar tensor).
    """

    def __init__(self, datasets: list[Any], weights: list[float], size: int | None, config: Any) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError("BlendedDataset needs one weight per dataset", params=("weights",))
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ConfigError(f"at most {np.iinfo(np.int16).max - 1} datasets can be blended")
        self.datasets = datasets
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.size = size
        self.config = config
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["datasets"] = [d.unique_identifiers for d in datasets]
        ids["split"] = datasets[0].index_split.name
        ids["weights"] = self.weights
        ids["size"] = size
        self.unique_identifiers = ids
        self.unique_description = dumps_description(ids)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._load_or_build()
        self._check_sizes()

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        if self.size is None:
            return helpers.build_exhaustive_blending_indices([len(d) for d in self.datasets])
        return helpers.build_blending_indices(np.asarray(self.weights), self.size)

    def _load_or_build(self) -> tuple[np.ndarray, np.ndarray]:
        directory = getattr(self.config, "path_to_cache", None)
        if not directory:
            return self._build()
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.unique_identifiers['split']}"
        paths = cache_paths(directory, base, BLEND_SUFFIXES)
        if not cache_complete(paths):
            arrays = build_or_wait(
                paths,
                self.unique_description,
                BLEND_SUFFIXES,
                self._build,
                self.config.cache_wait_timeout_s,
                self.config.emit,
            )
            if arrays is not None:
                return arrays
        cached = load_cache(paths, self.unique_description)
        return cached["dataset_index.npy"], cached["dataset_sample_index.npy"]

    def _check_sizes(self) -> None:
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (n, ds) in enumerate(zip(counts, self.datasets)):
            if n > len(ds):
                raise ConfigError(
                    f"the blend draws {n} samples from dataset {d} ({getattr(ds, 'dataset_path', '?')}) which "
                    f"has {len(ds)}; raise mid_level_dataset_surplus (now "
                    f"{getattr(self.config, 'mid_level_dataset_surplus', '?')})",
                    params=("mid_level_dataset_surplus",),
                )

    def realised_weights(self) -> list[float]:
        """Fraction of the blend's samples that each child provides."""
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        return (counts / max(len(self), 1)).tolist()

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": torch.tensor(dataset_id, dtype=torch.int64), **sample}
