"""GPTDataset: fixed-length samples cut from a shuffled stream of documents.

Samples are dicts of tensors (S = ``sequence_length``)::

    tokens        [S] int64    input ids
    labels        [S] int64    tokens shifted by one
    loss_mask     [S] float32  0 at padding (and at EOD with eod_mask_loss)
    position_ids  [S] int64    reset after each EOD with reset_position_ids
    attention_mask [1, S, S] bool, True = masked (Megatron's convention): causal, and block-diagonal
                   per document with reset_attention_mask; absent with create_attention_mask=False.
                   The plain causal mask is one cached tensor shared by every sample (read-only).

Document, sample and shuffle indices follow Megatron-LM (section 6.2 of the reference) and are
cached on disk under an MD5 of everything that determines them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron.core.config_utils import ConfigError
from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.errors import DataError
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, build_or_wait, cache_complete, cache_paths, load_cache

logger = logging.getLogger(__name__)
INDEX_SUFFIXES = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """What GPTDataset and MockGPTDataset need beyond BlendedMegatronDatasetConfig (Megatron-Core
    0.19.2's fields and defaults).

    Raises (from ``__post_init__``):
        ConfigError: no ``tokenizer``; ``hybrid_context_parallel`` (not built here); or
            ``sequences_per_dataset`` with a tokenizer of unknown ``vocab_size``.
    """

    reset_position_ids: bool | None = None
    """Restart position ids after each EOD (``--reset-position-ids``); None reads as False."""
    reset_attention_mask: bool | None = None
    """Block-diagonal attention per document (``--reset-attention-mask``); None reads as False."""
    eod_mask_loss: bool | None = None
    """No loss on EOD tokens (``--eod-mask-loss``); None reads as False."""
    create_attention_mask: bool = True
    """Emit the [1, S, S] attention mask in every sample, as Megatron does (False:
    ``--no-create-attention-mask-in-dataloader``; the model then attends causally)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the validation split's last, partial sample (False: keep it, padded)."""
    add_extra_token_to_sequence: bool = True
    """Read S + 1 tokens per sample so tokens and labels are both S long; False: read S, the last
    label is padding (no loss there) and consecutive samples do not overlap."""
    object_storage_cache_path: str | None = None
    """Accepted; object-storage paths (``s3://``, ``msc://``) are refused when a dataset is opened."""
    data_parallel_size: int = 1
    """Accepted; only hybrid context parallelism (not built here) reads it."""
    sequence_parallel_size: int = 0
    """Accepted; only hybrid context parallelism (not built here) reads it."""
    hybrid_context_parallel: bool = False
    """Not built here: True is refused."""
    sequences_per_dataset: dict[str, int] | None = None
    """Accepted (Megatron: counts that spare reading the ``.idx`` files); the index files are read."""
    token_dtype_code: int | None = field(init=False, default=None)
    """Derived: 4 (int32) for vocabularies over 65536 ids, else 8 (uint16)."""
    context_parallel_size: int | None = None
    """Accepted; only packed-sequence padding (not built here) reads it."""
    inter_document_masking: bool = False
    """Return ``cu_seqlens`` (document boundaries, padded to S + 1 entries with S), ``max_seqlen``
    and per-document ``position_ids`` instead of an attention mask."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ConfigError(
                "GPTDatasetConfig needs a tokenizer (its eod id and identifiers are used)",
                params=("tokenizer",),
            )
        if self.hybrid_context_parallel:
            raise ConfigError(
                "hybrid_context_parallel=True is not supported here; leave it False",
                params=("hybrid_context_parallel",),
            )
        vocab = getattr(self.tokenizer, "vocab_size", None)
        self.token_dtype_code = None if vocab is None else (4 if vocab > np.iinfo(np.uint16).max + 1 else 8)
        if self.sequences_per_dataset is not None and self.token_dtype_code is None:
            raise ConfigError(
                "sequences_per_dataset needs a tokenizer with a vocab_size",
                params=("sequences_per_dataset", "tokenizer"),
            )


def index_cache_dir(
    config: GPTDatasetConfig, dataset_path: str | None, class_name: str = "GPTDataset"
) -> str | None:
    """Where the index cache of ``dataset_path`` lives: ``--data-cache-path``, else
    ``<prefix>/cache/<class>_indices`` (None for data without a path). The dataset statistics of
    ``integrity.dataset_stats`` are cached there too."""
    if config.path_to_cache:
        return config.path_to_cache
    if dataset_path is None:
        return None
    return os.path.join(dataset_path, "cache", f"{class_name}_indices")


class GPTDataset(MegatronDataset):
    """Samples of ``sequence_length`` (+ 1 with ``add_extra_token_to_sequence``) tokens from a split
    of an indexed dataset.

    Args:
        indexed_dataset: the low-level dataset (``IndexedDataset`` or the mock one).
        dataset_path: its prefix (None for mock data).
        indexed_indices: the document ids of this split.
        num_samples: samples wanted (None: exactly one epoch); ``len(self) >= num_samples``.
        index_split: which split this is (part of the cache key).
        config: the GPTDatasetConfig.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self._cached_masks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._causal_mask: torch.Tensor | None = None
        self.num_epochs = 1
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build_indices()

    # ------------------------------------------------------------------ Megatron-Core class API
    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> Any:
        if str(dataset_path).startswith(("s3://", "msc://")):
            raise ConfigError(
                f"dataset path {dataset_path!r}: object storage (s3://, msc://) is not supported; "
                "copy the files to a local path"
            )
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    # ------------------------------------------------------------------ indices
    def _cache_dir(self) -> str | None:
        if self.config.mock:
            return self.config.path_to_cache or None
        return index_cache_dir(self.config, self.dataset_path, type(self).__name__)

    def _load_or_build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        directory = self._cache_dir()
        if directory is None:
            return self._build_indices()
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        paths = cache_paths(directory, base, INDEX_SUFFIXES)
        if not cache_complete(paths):
            arrays = build_or_wait(
                paths,
                self.unique_description,
                INDEX_SUFFIXES,
                self._build_indices,
                self.config.cache_wait_timeout_s,
                self.config.emit,
            )
            if arrays is not None:
                return arrays
        t0 = time.perf_counter()
        cached = load_cache(paths, self.unique_description)
        arrays = tuple(cached[s] for s in INDEX_SUFFIXES[1:])
        self._check_cached(arrays, paths["description.txt"])
        self.config.emit(
            f" > loaded {self.index_split.name} indices of {self.dataset_path} from cache "
            f"({len(arrays[2])} samples, {time.perf_counter() - t0:.3f} s)"
        )
        return arrays  # type: ignore[return-value]

    def _check_cached(self, arrays: tuple, where: str) -> None:
        """A cache made from other data (same path, regenerated files) must not load silently."""
        doc_index, sample_index, _ = arrays
        n_docs, S = len(self.indices), self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        ok = n_docs > 0 and len(doc_index) % n_docs == 0 or len(doc_index) == 0
        if ok and len(doc_index):
            self.num_epochs = len(doc_index) // n_docs
            total = self.num_epochs * int(self.dataset.sequence_lengths[self.indices].sum(dtype=np.int64))
            n = len(sample_index) - 1
            ok = (total - extra) // S <= n <= -(-(total - extra) // S)
            ok = ok and int(np.max(doc_index)) < len(self.dataset.sequence_lengths)
        if not ok:
            raise DataError(
                f"index cache {where!r} does not match the data files of {self.dataset_path}; "
                "delete the cache (or use a fresh path_to_cache)",
                params=("path_to_cache",),
            )

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        cfg = self.config
        S, extra = cfg.sequence_length, int(cfg.add_extra_token_to_sequence)
        sizes = np.asarray(self.dataset.sequence_lengths)
        tokens_per_epoch = int(sizes[self.indices].sum(dtype=np.int64)) if len(self.indices) else 0
        if tokens_per_epoch < S + extra:
            if self.num_samples:
                raise DataError(
                    f"{self.index_split.name} data: {len(self.indices)} documents of {self.dataset_path or 'mock data'} "
                    f"hold {tokens_per_epoch} tokens, fewer than one sample of {S + extra}; "
                    "give it a larger share with split or use more data",
                    params=("split",),
                )
            empty = np.zeros(0, np.int32)
            return empty, np.zeros((0, 2), np.int32), np.zeros(0, np.uint32)
        num_epochs = 1
        if self.num_samples is not None:
            while num_epochs * tokens_per_epoch < self.num_samples * S + extra:
                num_epochs += 1
        separate = False
        if num_epochs > 1:
            before = ((num_epochs - 1) * tokens_per_epoch - extra) // S
            from_last = self.num_samples - before
            per_epoch = (tokens_per_epoch - extra) // S
            assert 0 <= from_last <= per_epoch + 1
            separate = from_last < int(0.80 * per_epoch)
        rng = np.random.RandomState(cfg.random_seed)
        doc_index = helpers.build_document_index(self.indices, num_epochs, rng, separate)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = cfg.drop_last_partial_validation_sequence
        total = num_epochs * tokens_per_epoch
        n = (total - extra) // S if drop_last else -(-(total - extra) // S)
        sample_index = helpers.build_sample_index(sizes, doc_index, S, n, bool(extra), drop_last)
        n_first = ((num_epochs - 1) * tokens_per_epoch - extra) // S if separate else n
        shuffle_index = helpers.build_shuffle_index(n_first, n, rng)
        self.num_epochs = num_epochs
        cfg.emit(
            f" > built {self.index_split.name} indices of {self.dataset_path or 'mock data'}: "
            f"{len(self.indices)} documents, {tokens_per_epoch} tokens/epoch, {num_epochs} epoch(s), "
            f"{n} samples, separate last epoch: {separate} ({time.perf_counter() - t0:.2f} s)"
        )
        return doc_index, sample_index, shuffle_index

    # ------------------------------------------------------------------ samples
    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1) if len(self.sample_index) else 0

    def _query(self, idx: int) -> tuple[np.ndarray, list[int]]:
        """The S + extra token ids of sample ``idx`` (after the shuffle), padded if short, and the
        length of each document's part of them (before padding)."""
        j = int(self.shuffle_index[idx])
        beg, beg_off = (int(x) for x in self.sample_index[j])
        end, end_off = (int(x) for x in self.sample_index[j + 1])
        extra = int(self.config.add_extra_token_to_sequence)
        if beg == end:
            parts = [self.dataset.get(int(self.document_index[beg]), beg_off, end_off - beg_off + extra)]
        else:
            parts = []
            for i in range(beg, end + 1):
                offset = beg_off if i == beg else 0
                length = end_off + extra if i == end else None
                parts.append(self.dataset.get(int(self.document_index[i]), offset, length))
        lengths = [len(p) for p in parts]
        tokens = np.concatenate(parts).astype(np.int64)
        want = self.config.sequence_length + extra
        if len(tokens) < want:
            tokens = np.concatenate([tokens, np.full(want - len(tokens), self._pad_token_id, np.int64)])
        return tokens, lengths

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        S, extra = self.config.sequence_length, bool(self.config.add_extra_token_to_sequence)
        if idx is None and len(self) == 0:  # a padding sample of an empty dataset: all padding
            text = torch.full((S + int(extra),), self._pad_token_id, dtype=torch.int64)
            lengths: list[int] = []
        else:  # a padding sample (idx None) is sample 0 with no loss, as in Megatron
            try:
                raw, lengths = self._query(0 if idx is None else int(idx))
            except DataError as e:  # a file that changed under the run: which sample needed it
                raise DataError(f"{e} (reading sample {0 if idx is None else int(idx)})") from None
            text = torch.from_numpy(raw)
        if extra:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:  # the label after the last token is not in the sample
            tokens, labels = text, torch.roll(text, -1)
            labels[-1] = self._pad_token_id
        sample = self._masks(tokens)
        sample["loss_mask"][labels == self._pad_token_id] = 0.0
        if idx is None:
            sample["loss_mask"].zero_()
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        sample["tokens"], sample["labels"] = tokens, labels
        if self.config.inter_document_masking:
            sample.pop("attention_mask", None)
            sample.update(_document_boundaries(lengths, S, extra, sample["position_ids"]))
            keys: tuple[str, ...] = (
                "tokens",
                "labels",
                "loss_mask",
                "position_ids",
                "cu_seqlens",
                "max_seqlen",
            )
        else:
            keys = ("tokens", "labels", "attention_mask", "loss_mask", "position_ids")
        return {k: sample[k] for k in keys if k in sample}

    def _causal(self, S: int) -> torch.Tensor:
        """The [1, S, S] causal mask (True = key after query), built once and shared by every sample."""
        if self._causal_mask is None:
            self._causal_mask = torch.ones(S, S, dtype=torch.bool).triu(1).unsqueeze(0)
        return self._causal_mask

    def _masks(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.config
        S = tokens.numel()
        plain = not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss)
        causal = cfg.create_attention_mask and not cfg.reset_attention_mask
        if plain:
            if self._cached_masks is None:
                self._cached_masks = (torch.ones(S, dtype=torch.float32), torch.arange(S, dtype=torch.int64))
            loss_mask, pos = self._cached_masks
            out = {"loss_mask": loss_mask.clone(), "position_ids": pos.clone()}
            if causal:
                out["attention_mask"] = self._causal(S)
            return out
        eod = tokens == cfg.tokenizer.eod
        loss_mask = torch.ones(S, dtype=torch.float32)
        if cfg.eod_mask_loss:
            loss_mask[eod] = 0.0
        arange = torch.arange(S, dtype=torch.int64)
        # A new document starts right after each EOD token.
        starts = torch.zeros(S, dtype=torch.int64)
        starts[1:] = torch.where(eod[:-1], arange[1:], 0)
        seg_start = torch.cummax(starts, dim=0).values
        out = {"loss_mask": loss_mask}
        out["position_ids"] = arange - seg_start if cfg.reset_position_ids else arange
        if causal:
            out["attention_mask"] = self._causal(S)
        elif cfg.reset_attention_mask and cfg.create_attention_mask:
            after = arange[None, :] > arange[:, None]  # [S, S] key after query
            other_doc = arange[None, :] < seg_start[:, None]  # key before the query's document
            out["attention_mask"] = (after | other_doc).unsqueeze(0)  # [1, S, S], True = masked
        return out


def _document_boundaries(
    lengths: list[int], S: int, extra: bool, position_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``cu_seqlens`` ([S + 1] int32: 0, the end of each document part, then S repeated),
    ``max_seqlen`` and ``position_ids`` restarting at each part. Padding joins the last part."""
    lengths = list(lengths)
    if extra and lengths:  # the extra token only feeds the last label
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = S - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    padded = torch.full((S + 1,), S, dtype=torch.int32)
    padded[: cu.numel()] = cu
    return {"cu_seqlens": padded, "max_seqlen": (cu[1:] - cu[:-1]).max(), "position_ids": position_ids}


class MockGPTLowLevelDataset:
    """100,000 synthetic documents: lengths uniform in [1, 4096) from ``default_rng(0)``;
    document i is ``(1 .. len-1) mod vocab`` followed by EOD. Nothing is materialised."""

    size = 100_000
    max_sequence_length = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sequence_lengths = np.random.default_rng(0).integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        length = n - offset if length is None else length
        pos = np.arange(offset, offset + length, dtype=np.int64)
        out = (pos + 1) % int(self.tokenizer.vocab_size)
        out[pos == n - 1] = self.tokenizer.eod
        return out


class MockGPTDataset(GPTDataset):
    """GPTDataset over ``MockGPTLowLevelDataset``: real index machinery, synthetic tokens."""

    def __init__(
        self,
        dataset: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
