"""Logging on one rank: :func:`log_single_rank` (Megatron-Core's, re-exported by
``megatron.core.utils`` and ``megatron.core.datasets.utils``). Imports torch only, so that the data
pipeline can log without importing the model stack."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only (every process when
    torch.distributed is not initialised counts as rank 0)."""
    if (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0) == rank:
        logger.log(*args, **kwargs)
