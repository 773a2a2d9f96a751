"""Send a micro-batch from the first rank of the tp group to the others.

``broadcast_batch`` is the library's form (shapes known on every rank, explicit group and source).
``broadcast_data(keys, data, datatype)`` is Megatron-Core's: one dtype, shapes known only on the
source, the default tp group; it sends the shapes first and then calls ``broadcast_batch``.

Only tp rank 0 reads the data loader (the tp ranks of one model replica consume the same batch);
the others receive it. Shapes and dtypes are known in advance (micro-batch size x sequence
length), so nothing is pickled on the hot path: the tensors of each dtype are packed into one flat
buffer and sent with one broadcast per dtype (one in the usual all-int64 case).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import ProcessGroup, default_tp_group, group_rank, group_size

TensorSpec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of one entry of the batch


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _check_source(
    keys: Sequence[str], data: Mapping[str, torch.Tensor] | None, specs: Mapping[str, TensorSpec]
) -> Mapping[str, torch.Tensor]:
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


def broadcast_batch(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    specs: Mapping[str, TensorSpec],
    group: ProcessGroup | None,
    src_rank: int,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
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


_MAX_DIMS = 8  # dims of one tensor whose shape broadcast_data sends


def _collective_device(group: ProcessGroup | None) -> torch.device:
    """Where a collective of ``group`` runs: the current CUDA device for NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_megatron_source(
    keys: Sequence[str], data: Mapping[str, torch.Tensor] | None, datatype: torch.dtype
) -> Mapping[str, torch.Tensor]:
    if data is None:
        raise ValueError("broadcast_data: tp rank 0 must pass the data (data is None)")
    for key in keys:
        if key not in data:
            raise ValueError(f"broadcast_data: key {key!r} is missing from data (has {sorted(data)})")
        t = data[key]
        if t.dtype != datatype:
            raise ValueError(
                f"broadcast_data: {key!r} is {t.dtype}; every tensor must be datatype={datatype}"
            )
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"broadcast_data: {key!r} has {t.dim()} dims; at most {_MAX_DIMS} are supported")
    return data


def _shapes_from_source(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    group: ProcessGroup,
    src: int,
    device: torch.device,
) -> dict[str, TensorSpec]:
    """The source's shapes of ``data[k]``, sent to every rank of ``group``."""
    sizes = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64)
    if group_rank(group) == 0:
        data = _check_megatron_source(keys, data, datatype)
        for i, key in enumerate(keys):
            t = data[key]
            sizes[i, 0] = t.dim()
            sizes[i, 1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    sizes = sizes.to(device)
    dist.broadcast(sizes, src=src, group=group)
    rows = sizes.cpu().tolist()
    return {key: (tuple(row[1 : 1 + row[0]]), datatype) for key, row in zip(keys, rows)}


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype | Mapping[str, TensorSpec],
    tp_group: ProcessGroup | None = None,
    *,
    src_rank: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron-Core's form: rank 0 of the tp group has ``data`` (``key -> tensor``, every one of
    ``datatype``); every rank of the group returns ``key -> tensor`` with its values and shapes.

    Args:
        keys: the entries to send, the same on every rank.
        data: the tensors on tp rank 0 (any device); ignored on the other ranks.
        datatype: their dtype. A mapping ``key -> (shape, dtype)`` instead selects
            :func:`broadcast_batch` (``tp_group``, ``src_rank`` and ``device`` passed on to it).
        tp_group: the group; default the default ParallelState's tp group.

    Returns:
        The tensors on the device the group's collectives run on (the current GPU for NCCL, else
        the CPU); one flat buffer's views.

    Raises:
        ValueError: on tp rank 0 a key is missing or a tensor is not of ``datatype``.
    """
    if isinstance(datatype, Mapping):
        if src_rank is None:
            raise ValueError(
                "broadcast_data(keys, data, specs, group, src_rank=...): pass the source's global rank"
            )
        return broadcast_batch(keys, data, datatype, tp_group, src_rank=src_rank, device=device)
    group = default_tp_group(tp_group)
    out_device = _collective_device(group) if device is None else torch.device(device)
    if group_size(group) == 1:
        data = _check_megatron_source(keys, data, datatype)
        specs: dict[str, TensorSpec] = {k: (tuple(data[k].shape), datatype) for k in keys}
        return broadcast_batch(keys, data, specs, None, src_rank=0, device=out_device)
    assert group is not None
    src = dist.get_process_group_ranks(group)[0]
    specs = _shapes_from_source(keys, data, datatype, group, src, _collective_device(group))
    return broadcast_batch(keys, data, specs, group, src_rank=src, device=out_device)
