"""Checkpoints of delayed scaling's amax histories, so that a resumed run scales as the uninterrupted one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.fusions.fp8.module import Fp8Gemm


def _delayed_gemms(chunks: Sequence[nn.Module]) -> Iterator[tuple[nn.Module, str, Fp8Gemm]]:
    """``(chunk, local name, Fp8Gemm)`` for every delayed-scaling FP8 GEMM of ``chunks`` (GPT model
    chunks, maybe in a DistributedDataParallel wrapper)."""
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for name, module in chunk.named_modules():
            if isinstance(module, Fp8Gemm) and module.recipe.recipe == "delayed":
                yield chunk, name, module


def fp8_sharded_state_dict(
    chunks: Sequence[nn.Module], tp_rank: int, dp_rank: int
) -> dict[str, ShardedTensor]:
    """The amax history and ``initialized`` flags of every delayed-scaling FP8 GEMM of ``chunks``
    (GPT model chunks), under the layout-independent name of its linear (``decoder.layers.<global
    index>...fp8.amax_history``). They are the same on every rank of the amax reduction group, so
    they are stored once, like replicated weights (tp rank 0, dp rank 0 of each pipeline stage)."""
    out = {}
    for chunk, name, module in _delayed_gemms(chunks):
        key = chunk.global_param_name(name)  # type: ignore[operator]
        for buf in ("amax_history", "initialized"):
            out[f"{key}.{buf}"] = ShardedTensor.from_rank_offsets(
                f"{key}.{buf}", getattr(module, buf), replica_id=(tp_rank, dp_rank)
            )
    return out


def fp8_state_loaded(chunks: Sequence[nn.Module]) -> None:
    """After the histories were read into the buffers: those with entries count as warm."""
    for _, _, module in _delayed_gemms(chunks):
        module.warm = bool(module.initialized.any())
