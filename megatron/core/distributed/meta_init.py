"""Materialise a model chunk that FSDP2 sharded while it was still on the meta device.

With ``init_model_with_meta_device`` a chunk is built on the meta device and ``fully_shard`` turns each
parameter (this rank's tensor-parallel shard) into a DTensor sharded ``Shard(0)`` over the
data-parallel mesh, still on meta. ``materialize_fsdp_shards_`` then allocates only each rank's local
rows and fills them with exactly the rows of the logical tensor they cover (``init_param_rows_``), so no
rank ever holds, or generates, a whole parameter, and the weights are bitwise those of a single-process
run with the same seed (the layout-invariant initialisation of ``tensor_parallel.init``).

``fully_shard`` replaces every parameter by a new DTensor parameter and ``nn.Module.to_empty`` swaps
their contents, both dropping the Python attributes our layers attach (the init recipe,
``tensor_model_parallel``, ``sequence_parallel``, ``shared``, ...): carry them across ``fully_shard``
with ``param_attrs`` before and ``restore_param_attrs_`` after; ``materialize_fsdp_shards_`` keeps them
across its own ``to_empty``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.fusions.fp8 import Fp8Gemm
from megatron.core.tensor_parallel.init import init_param_, init_param_rows_


def param_attrs(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The public Python attributes of each parameter of ``module``, by parameter name."""
    return {
        name: {key: value for key, value in vars(param).items() if not key.startswith("_")}
        for name, param in module.named_parameters()
    }


def restore_param_attrs_(module: nn.Module, attrs: dict[str, dict[str, Any]]) -> None:
    """Set each parameter's attributes recorded by ``param_attrs`` (parameter names are unchanged by
    ``fully_shard``; a name not in ``attrs`` is left as it is)."""
    for name, param in module.named_parameters():
        for key, value in attrs.get(name, {}).items():
            setattr(param, key, value)


def dim0_shard_range(param: DTensor) -> tuple[int, int]:
    """The rows [start, stop) of ``param``'s global dim 0 that this rank's local tensor holds.

    ``Shard(0)`` on a mesh dimension of size n splits the rows left by the previous mesh dimensions as
    ``torch.chunk`` does (ceil(rows / n) rows per coordinate, the last ones shorter or empty);
    ``Replicate`` keeps them (HSDP's replica dimension).

    Raises:
        ValueError: a placement other than ``Shard(0)`` or ``Replicate``.
    """
    start, stop = 0, param.shape[0]
    coordinate = param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Shard and placement.dim == 0:
            size, index = param.device_mesh.size(mesh_dim), coordinate[mesh_dim]
            chunk = -(-(stop - start) // size)
            start, stop = min(start + index * chunk, stop), min(start + (index + 1) * chunk, stop)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"meta-device initialisation fills dim-0 shards only; a parameter is placed {placement}"
            )
    return start, stop


@torch.no_grad()
def materialize_fsdp_shards_(
    module: nn.Module,
    device: torch.device,
    seed: int,
    tp_rank: int,
    name_of: Callable[[str], str],
) -> None:
    """Allocate ``module``'s meta tensors on ``device``, only the local shard of each DTensor parameter,
    and initialise them as ``GPTModel`` would (FP8 scaling state zeroed).

    Args:
        module: a chunk after ``fully_shard``, on the meta device, its parameters carrying their init
            recipes (``restore_param_attrs_``).
        device: this rank's device.
        seed: the initialisation seed (``GPTModel``'s ``seed``).
        tp_rank: this rank's tensor-parallel rank (the parameters are its tensor-parallel shards).
        name_of: a parameter's name in ``module.named_parameters()`` -> its layout-independent name
            (``GPTModel.global_param_name``).

    Raises:
        ValueError: a parameter without an init recipe (its attributes were not carried across
            ``fully_shard``), or a DTensor placed other than ``Shard(0)`` / ``Replicate``.
    """
    attrs = param_attrs(module)
    for name, recipe in attrs.items():
        if "init_std" not in recipe:
            raise ValueError(
                f"parameter {name} carries no init recipe (init_std); fully_shard drops parameter "
                "attributes: carry them with param_attrs / restore_param_attrs_"
            )
    module.to_empty(device=device)  # FSDP2's _apply re-registers each padded local shard
    restore_param_attrs_(module, attrs)
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            start, stop = dim0_shard_range(param)
            local = param.to_local()  # under no_grad: the local tensor itself
            assert local.shape[0] == stop - start, (name, tuple(local.shape), start, stop)
            init_param_rows_(local, param, name_of(name), seed, tp_rank, start, stop)
        else:
            init_param_(param, name_of(name), seed, tp_rank)
    for sub in module.modules():  # FP8 scaling state starts empty (to_empty left it undefined)
        if isinstance(sub, Fp8Gemm):
            sub.reset_scaling_state_()
