"""Turn a DataConfig into the train/valid/test datasets (the application's data provider)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.errors import DataError
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, index_cache_dir
from megatron.core.datasets.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megatron.core.datasets.integrity import dataset_stats
from megatron.core.datasets.utils import Split, get_blend_from_list

DEFAULT_SPLIT = "969, 30, 1"


def _check_prefixes(blend: tuple[list[str], list[float] | None] | None, flag: str, mmap: bool) -> None:
    """Open every prefix once so a missing or corrupt file fails here, naming the flag."""
    if blend is None:
        return
    for prefix in blend[0]:
        for path in (index_file_path(prefix), data_file_path(prefix)):
            try:
                open(path, "rb").close()
            except OSError as exc:
                raise DataError(
                    f"{flag}: cannot read {path!r} ({exc.strerror}); give the prefix without "
                    ".bin/.idx, as written by tools/preprocess_data.py"
                ) from None
        try:
            IndexedDataset(prefix, mmap=mmap)
        except DataError as exc:
            raise DataError(f"{flag}: {exc}", params=exc.params) from None


def is_dataset_built_on_rank(parallel_state: Any | None) -> bool:
    """Datasets live on tensor-parallel rank 0 of the first and last pipeline stages."""
    if parallel_state is None:
        return True
    first_or_last = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    return parallel_state.tp_rank == 0 and first_or_last


def core_gpt_dataset_config(
    data_cfg: Any, tokenizer: Any, seq_length: int, seed: int, log: Callable[[str], Any] = print
) -> GPTDatasetConfig:
    """The GPTDatasetConfig a DataConfig describes (blend, per-split blends or mock data).

    Raises:
        ConfigError, DataError: no data source, a missing/corrupt file (naming the flag), or bad weights.
    """
    blend = get_blend_from_list(data_cfg.data_path)
    per_split = [
        get_blend_from_list(getattr(data_cfg, f"{s}_data_path", None), f"--{s}-data-path")
        for s in ("train", "valid", "test")
    ]
    has_per_split = any(b is not None for b in per_split)
    if not data_cfg.mock_data and blend is None and not has_per_split:
        raise ConfigError("no training data: give --data-path (or --train-data-path ...) or --mock-data")
    if data_cfg.mock_data and (blend is not None or has_per_split):
        raise ConfigError("--mock-data cannot be combined with --data-path or --train/valid/test-data-path")
    mmap = getattr(data_cfg, "mmap_bin_files", True)
    split = data_cfg.split
    if blend is not None:
        _check_prefixes(blend, "--data-path", mmap)
        if split is None:
            log(f"WARNING: --split not given; using the default {DEFAULT_SPLIT!r}")
            split = DEFAULT_SPLIT
    for name, b in zip(("train", "valid", "test"), per_split):
        _check_prefixes(b, f"--{name}-data-path", mmap)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split if has_per_split else None,
        split=split if not has_per_split else None,
        path_to_cache=data_cfg.data_cache_path,
        mmap_bin_files=mmap,
        tokenizer=tokenizer,
        reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss,
        # The trainer never reads a sample's mask: causal attention needs none, and with
        # --reset-attention-mask it builds a DocumentMask from the tokens on the device (gpt.py's
        # attention_mask_source), so no [s, s] mask is built per sample, whatever
        # --create-attention-mask-in-dataloader says.
        create_attention_mask=False,
        mid_level_dataset_surplus=data_cfg.mid_level_dataset_surplus,
        log=log,
    )


def named_prefixes(config: GPTDatasetConfig) -> dict[str, str]:
    """Every dataset prefix of the config, each once, with the flag that names it."""
    out: dict[str, str] = {}
    blends = [("--data-path", config.blend)]
    if config.blend_per_split is not None:
        blends += [
            (f"--{name}-data-path", b) for name, b in zip(("train", "valid", "test"), config.blend_per_split)
        ]
    for flag, blend in blends:
        for prefix in blend[0] if blend is not None else []:
            out.setdefault(prefix, flag)
    return out


def describe_tokenizer(tokenizer: Any) -> str:
    """``NullTokenizer (--vocab-size 128: ids 0 to 127)``; others name their file."""
    ids = f"ids 0 to {tokenizer.vocab_size - 1}"
    if type(tokenizer).__name__ == "NullTokenizer":
        return f"NullTokenizer (--vocab-size {tokenizer.vocab_size}: {ids})"
    paths = getattr(tokenizer, "unique_identifiers", {}).get("tokenizer_path") or []
    return f"{type(tokenizer).__name__} ({repr(paths[0]) + ': ' if paths else ''}{ids})"


def check_token_ids(
    flag: str,
    prefix: str,
    token_range: tuple[int | None, int | None],
    tokenizer: Any,
    padded_vocab_size: int | None,
) -> None:
    """Refuse data whose ids the model cannot take as they are meant.

    The bound is the tokenizer's vocabulary, not the padded one the embedding is built with: an id
    at or beyond the padded size indexes past the embedding (an IndexError on the CPU, a
    device-side assert on a GPU, at whichever step first draws it), and an id between the two
    selects a padding row, which the tokenizer never produces, so the data was made with another
    tokenizer (or is corrupt) and would train silently on the wrong ids. No valid data holds either.

    Raises:
        DataError: naming the flag, the ``.bin``, the id, the tokenizer and what the id would do.
    """
    lo, hi = token_range
    if lo is None or hi is None:
        return
    vocab = int(tokenizer.vocab_size)
    rows = vocab if padded_vocab_size is None else int(padded_vocab_size)
    where = f"{flag}: {data_file_path(prefix)!r} holds token id"
    fix = "Train with the tokenizer the data was made with, or preprocess the data again with this one"
    if lo < 0:
        raise DataError(
            f"{where} {lo}, a negative id that no tokenizer produces (the data is corrupt); {fix}"
        )
    if hi < min(vocab, rows):
        return
    if hi < vocab:  # an explicit --padded-vocab-size below the tokenizer's vocabulary
        raise DataError(
            f"{where} {hi}, beyond the model's embedding of {rows} rows (--padded-vocab-size {rows}) "
            f"though inside the vocabulary of {describe_tokenizer(tokenizer)}; give a larger --padded-vocab-size"
        )
    effect = (
        f"index past the model's embedding of {rows} rows"
        if hi >= rows
        else f"train padding row {hi} of the model's embedding of {rows} rows"
    )
    raise DataError(
        f"{where} {hi}, outside the vocabulary of {describe_tokenizer(tokenizer)}; it would {effect}. {fix}"
    )


def check_data(
    config: GPTDatasetConfig, padded_vocab_size: int | None = None, log: Callable[[str], Any] = print
) -> None:
    """Before any index is built: every dataset passes ``integrity.verify_dataset`` and its token ids
    fit the vocabulary (``check_token_ids``). Both come from ``integrity.dataset_stats``, computed
    once per version of the files (global rank 0; the first time a scan of the ``.bin`` unless its
    checksum record holds the ids) and read from the index cache directory afterwards.

    Raises:
        DataError: on every rank alike, naming the flag and the file.
    """
    for prefix, flag in named_prefixes(config).items():
        cache_dir = index_cache_dir(config, prefix)
        assert cache_dir is not None
        try:
            stats = dataset_stats(
                IndexedDataset(prefix, mmap=config.mmap_bin_files),
                cache_dir,
                config.cache_wait_timeout_s,
                log,
            )
        except DataError as exc:
            raise DataError(f"{flag}: {exc}", params=exc.params) from None
        check_token_ids(
            flag, prefix, (stats["token_id_min"], stats["token_id_max"]), config.tokenizer, padded_vocab_size
        )


SPLIT_NAMES = ("train", "validation", "test")
WITHOUT_SPLIT = ("no training", "no validation", "no test evaluation")


def report_empty_splits(empty: dict[Split, str], log: Callable[[str], Any] = print) -> None:
    """One line per split that holds no sample and is therefore not built (Megatron's rule for an
    empty split: what needs it is skipped). An empty train split that training needs is refused by
    the builder instead, on every rank alike."""
    for split in sorted(empty, key=lambda s: s.value):
        log(f" > {SPLIT_NAMES[split.value]} split is empty ({empty[split]}): {WITHOUT_SPLIT[split.value]}")


def build_train_valid_test_datasets(
    data_cfg: Any,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: list[int],
    parallel_state: Any | None = None,
    log: Callable[[str], Any] = print,
    padded_vocab_size: int | None = None,
) -> tuple[Any, Any, Any]:
    """Build the three datasets on the ranks that hold data (None elsewhere and for unbuilt splits).

    Every rank must call this. Global rank 0 builds missing index caches; the other ranks poll for
    the finished files (no collective with a timeout is involved while rank 0 works).

    Args:
        data_cfg: a ``DataConfig``.
        tokenizer: a ``MegatronTokenizer``.
        seq_length: tokens per sample.
        seed: ``--seed`` (document and sample shuffles).
        train_valid_test_num_samples: samples wanted per split.
        parallel_state: this rank's ``ParallelState`` (None: a single process).
        log: where progress and the blend report go.
        padded_vocab_size: the vocabulary the model's embedding is built with (``check_data``).

    Raises:
        ConfigError, DataError: a user error in the data flags (raised on every rank alike), e.g. an empty
            train split (``BlendedMegatronDatasetBuilder.empty_splits``), a dataset that fails its
            checks or holds ids outside the vocabulary (``check_data``).
    """
    config = core_gpt_dataset_config(data_cfg, tokenizer, seq_length, seed, log)
    cls = MockGPTDataset if config.mock else GPTDataset
    built_here = is_dataset_built_on_rank(parallel_state)
    log(
        f"> building train, validation, and test datasets for GPT ({'mock data' if config.mock else 'indexed data'}) ..."
    )
    if not config.mock:
        check_data(config, padded_vocab_size, log)
    builder = BlendedMegatronDatasetBuilder(
        cls, list(train_valid_test_num_samples), lambda: built_here, config
    )
    report_empty_splits(builder.empty_splits(), log)
    datasets = builder.build()
    for name, ds, want in zip(SPLIT_NAMES, datasets, train_valid_test_num_samples):
        if ds is None:
            continue
        if isinstance(ds, BlendedDataset):
            log(f"    {name}: {len(ds)} samples (requested {want}) blended from {len(ds.datasets)} datasets")
        else:
            log(
                f"    {name}: {len(ds)} samples (requested {want}), {ds.num_epochs} epoch(s) of "
                f"{ds.dataset_path or 'mock data'}"
            )
    log("> finished creating GPT datasets ...")
    return datasets[0], datasets[1], datasets[2]
