"""MegatronTokenizer: Megatron-Core's entry point that restores a tokenizer from its metadata.

The metadata (a ``tokenizer_metadata.json`` beside the tokenizer, or a dict) names the ``library``
(``null-text``, ``sentencepiece``, ``huggingface``, ``megatron``, ``tiktoken``, ``byte-level``) and optionally a
``model_type`` (``default-text``, ``gpt``, ``mamba``, ``bert``, ``t5``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from megatron.core.config_utils import ConfigError
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron.core.tokenizers.text.models import MODEL_TYPES

TEXT_LIBRARIES = ["sentencepiece", "huggingface", "megatron", "tiktoken", "byte-level", "null-text", "sft"]
VISION_LIBRARIES = ["multimodal", "null-multimodal"]
PATHLESS_LIBRARIES = ("byte-level", "null-text", "null-multimodal")
METADATA_FILE = "tokenizer_metadata.json"

logger = logging.getLogger(__name__)


class MegatronTokenizer:
    """Not instantiated: use ``MegatronTokenizer.from_pretrained`` (and ``write_metadata``)."""

    def __init__(self) -> None:
        raise OSError("MegatronTokenizer is not instantiated; call MegatronTokenizer.from_pretrained(...)")

    @staticmethod
    def from_pretrained(
        tokenizer_path: str | None = None, metadata_path: str | dict | None = None, **kwargs: Any
    ) -> MegatronTokenizerBase:
        """The tokenizer at ``tokenizer_path`` as its metadata describes it.

        Args:
            tokenizer_path: the tokenizer file or directory (for ``megatron``, the type name
                ``"GPT2BPETokenizer"``); not needed by ``null-text``.
            metadata_path: a metadata JSON file, or the metadata dict itself; default
                ``tokenizer_metadata.json`` in ``tokenizer_path``'s directory.
            **kwargs: the library's options (``vocab_size=`` for ``null-text``, ``vocab_file=`` /
                ``merges_file=`` for ``megatron`` ...). ``metdata_path=``, the spelling of
                Megatron-LM's run_simple_mcore_train_loop.py, is read as ``metadata_path``.

        Returns:
            a ``MegatronTokenizerText`` (``tokenize``, ``detokenize``, ``vocab_size``, ``eod``, ...).

        Raises:
            ValueError: no metadata can be found, a missing ``tokenizer_path``, or a library,
                model type or option that is unknown or not provided here (each named).
        """
        if metadata_path is None and "metdata_path" in kwargs:
            metadata_path = kwargs.pop("metdata_path")
        if not metadata_path:
            if not tokenizer_path:
                raise ConfigError(
                    "give metadata_path (e.g. {'library': 'null-text'}) or tokenizer_path with a "
                    f"{METADATA_FILE} beside it"
                )
            metadata_path = _default_metadata_path(tokenizer_path)
        metadata = _read_metadata(metadata_path)
        library = metadata.get("library")
        if library in VISION_LIBRARIES:
            raise ConfigError(f"tokenizer library {library!r}: vision/multimodal tokenizers are not provided")
        if library not in PATHLESS_LIBRARIES and not tokenizer_path:
            raise ConfigError(
                f"tokenizer library {library!r} needs tokenizer_path (the tokenizer file or directory)"
            )
        metadata["metadata_path"] = metadata_path if isinstance(metadata_path, str) else None
        return _model_class(metadata)(tokenizer_path, metadata, **kwargs)

    @staticmethod
    def write_metadata(
        tokenizer_path: str,
        tokenizer_library: str,
        model_type: str | None = None,
        tokenizer_class: type | None = None,
        chat_template: str | None = None,
        overwrite: bool = False,
        metadata_path: str | None = None,
    ) -> None:
        """Write the metadata JSON ``from_pretrained`` reads (default: ``tokenizer_metadata.json``
        beside ``tokenizer_path``) with ``library``, ``class_name``, ``class_path``, ``model_type``
        (default ``"default-text"``) and ``chat_template``.

        Raises:
            ValueError: ``tokenizer_path`` does not exist, an unknown library, or the file
                exists and ``overwrite`` is False.
        """
        if not os.path.exists(tokenizer_path):
            raise ConfigError(f"tokenizer_path {tokenizer_path!r} does not exist")
        if tokenizer_library not in TEXT_LIBRARIES + VISION_LIBRARIES:
            raise ConfigError(
                f"tokenizer_library {tokenizer_library!r} is not valid; choose one of "
                f"{TEXT_LIBRARIES + VISION_LIBRARIES}"
            )
        kind = "text" if tokenizer_library in TEXT_LIBRARIES else "vision"
        if model_type is None and tokenizer_class is None:
            model_type = f"default-{kind}"
        path = metadata_path or _default_metadata_path(tokenizer_path)
        if os.path.exists(path) and not overwrite:
            raise ConfigError(f"metadata file {path!r} exists; pass overwrite=True to replace it")
        metadata = {
            "library": tokenizer_library,
            "class_name": tokenizer_class.__name__ if tokenizer_class else None,
            "class_path": tokenizer_class.__module__ if tokenizer_class else None,
            "model_type": model_type,
            "chat_template": chat_template,
        }
        with open(path, "w") as f:
            json.dump(metadata, f)
        logger.info("wrote tokenizer metadata %s", path)


def _default_metadata_path(tokenizer_path: str) -> str:
    directory = os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
    return os.path.join(directory, METADATA_FILE)


def _read_metadata(metadata_path: str | dict) -> dict[str, Any]:
    if isinstance(metadata_path, dict):
        return dict(metadata_path)
    if not isinstance(metadata_path, str):
        raise ValueError(f"metadata_path must be a str or a dict, got {type(metadata_path).__name__}")
    if not os.path.exists(metadata_path):
        raise ConfigError(
            f"tokenizer metadata file {metadata_path!r} does not exist; write it with "
            "MegatronTokenizer.write_metadata(...) or pass metadata_path={'library': ...}"
        )
    with open(metadata_path) as f:
        return dict(json.load(f))


def _model_class(metadata: dict[str, Any]) -> type:
    model_type = metadata.get("model_type") or "default-text"
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"tokenizer model_type {model_type!r} is not provided; choose one of {sorted(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]
