"""Index arithmetic of GPTDataset and BlendedDataset, vectorised with numpy.

These produce exactly the arrays Megatron-LM's C++ helpers (``build_sample_idx``,
``build_blending_indices``) produce for the same inputs.
"""

from __future__ import annotations

import numpy as np


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times and shuffled (int32); the last epoch separately
    when ``separate_final_epoch``. Consumes ``rng`` in Megatron's order."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_samples: int,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
) -> np.ndarray:
    """Rows ``(position in document_index, token offset)`` where each sample begins, plus one row
    where the last one ends: shape ``[num_samples + 1, 2]``.

    Sample ``j`` covers global tokens ``[j * S, j * S + S + extra)`` of the concatenated documents
    (the last token of a sample is the first of the next one when ``add_extra_token``); without
    ``drop_last_partial_sequence`` the last sample ends with the last token.

    Args:
        sizes: tokens of every document of the low-level dataset.
        document_index: document order (``build_document_index``).
        sequence_length: S.
        num_samples: samples to index (``(total - extra) // S``, or one more with a partial sample).
    """
    extra = int(add_extra_token)
    doc_sizes = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)  # ends[k] = tokens in documents [0, k]
    total = int(ends[-1]) if len(ends) else 0
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    if not drop_last_partial_sequence and num_samples > 0:
        positions[-1] = min(int(positions[-1]), total - extra)
    # With the extra token a row names the document holding token p (first k with ends[k] > p);
    # without it p is an exclusive end, so a sample ending with a document names that document at
    # offset len(document) (first k with ends[k] >= p), as Megatron's helper does. Both skip empty
    # documents and keep the last row inside the array.
    doc = np.searchsorted(ends, positions, side="right" if extra else "left")
    starts = ends[doc] - doc_sizes[doc]
    dtype = np.int32 if max(len(document_index), sequence_length + total) < 2**31 - 1 else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = doc
    out[:, 1] = positions - starts
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy "largest sampling error" blend: sample ``i`` comes from the dataset maximising
    ``w_d * max(i, 1) - count_d`` (ties to the lower index).

    Returns:
        ``dataset_index`` (int16, [size]) and ``dataset_sample_index`` (int64, [size]): the
        dataset of each sample and the running count within that dataset.
    """
    w = [float(x) for x in weights]
    num = len(w)
    counts = [0] * num
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    # A plain loop with Python floats: the same double arithmetic as the C++ helper.
    ds_list = [0] * size
    sample_list = [0] * size
    order = range(num)
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for d in order:
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        ds_list[i] = best
        sample_list[i] = counts[best]
        counts[best] += 1
    dataset_index[:] = ds_list
    sample_index[:] = sample_list
    return dataset_index, sample_index


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Draw every sample of every dataset exactly once (the blend with ``size=None``), interleaved
    by the greedy rule with weights proportional to ``sizes`` among datasets not yet exhausted."""
    total = int(sum(sizes))
    w = [n / max(total, 1) for n in sizes]
    counts = [0] * len(sizes)
    ds_list = [0] * total
    sample_list = [0] * total
    for i in range(total):
        x = float(i) if i > 1 else 1.0
        best, best_err = -1, 0.0
        for d, n in enumerate(sizes):
            if counts[d] < n:
                err = w[d] * x - counts[d]
                if best < 0 or err > best_err:
                    best, best_err = d, err
        ds_list[i] = best
        sample_list[i] = counts[best]
        counts[best] += 1
    return np.asarray(ds_list, dtype=np.int16), np.asarray(sample_list, dtype=np.int64)
