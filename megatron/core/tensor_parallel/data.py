"""Send a micro-batch from the first rank of the tp group to the others.

Only tp rank 0 reads the data loader (the tp ranks of one model replica consume the same batch);
the others receive it. Shapes and dtypes are known in advance (micro-batch size x sequence
length), so nothing is pickled on the hot path: the tensors of each dtype are packed into one flat
buffer and sent with one broadcast per dtype (one in the usual all-int64 case).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import ProcessGroup, group_size

TensorSpec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of one entry of the batch


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _check_source(keys: Sequence[str], data: Mapping[str, torch.Tensor] | None,
                  specs: Mapping[str, TensorSpec]) -> Mapping[str, torch.Tensor]:
    if data is None:
        raise ValueError("broadcast_data: the source rank must pass the batch (data is None)")
    for key in keys:
        if key not in data:
            raise ValueError(f"broadcast_data: key {key!r} is missing from the batch (has {sorted(data)})")
        shape, dtype = specs[key]
        t = data[key]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"broadcast_data: {key!r} is {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}"
            )
    return data


def broadcast_data(keys: Sequence[str], data: Mapping[str, torch.Tensor] | None,
                   specs: Mapping[str, TensorSpec], group: ProcessGroup | None, src_rank: int,
                   device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Broadcast ``data[k]`` for every ``k`` in ``keys`` from ``src_rank`` to the ranks of ``group``.

    Args:
        keys: the entries to send, in a fixed order (the same on every rank).
        data: the batch on the source rank (tensors on any device); ignored elsewhere (pass None).
        specs: ``key -> (shape, dtype)``, the same on every rank; the source's tensors must match.
        group: the tensor-parallel group; ``None`` or one rank means no communication.
        src_rank: the *global* rank of the source (the group's first rank in Megatron).
        device: where the result lives (the device the collective runs on: the GPU for NCCL);
            default the CPU.

    Returns:
        ``key -> tensor`` on ``device`` with the given shapes and dtypes, equal on every rank.
        Tensors of one dtype are views into one buffer.

    Raises:
        ValueError: the source's batch lacks a key or a tensor does not match its spec.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    is_src = group_size(group) == 1 or dist.get_rank() == src_rank
    batch = _check_source(keys, data, specs) if is_src else {}
    if group_size(group) == 1:
        return {k: batch[k].to(device) for k in keys}

    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in keys:
        by_dtype.setdefault(specs[key][1], []).append(key)
    out: dict[str, torch.Tensor] = {}
    for dtype, dtype_keys in by_dtype.items():
        numels = [_numel(specs[k][0]) for k in dtype_keys]
        if is_src:
            flat = torch.cat([batch[k].reshape(-1).to(device) for k in dtype_keys])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        dist.broadcast(flat, src=src_rank, group=group)
        for key, part in zip(dtype_keys, flat.split(numels)):
            out[key] = part.view(*specs[key][0])
    return {k: out[k] for k in keys}
