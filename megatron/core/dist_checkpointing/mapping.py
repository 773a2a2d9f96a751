"""Sharded state dict vocabulary: how a local tensor or object relates to the global one it is a piece of.

A model's ``sharded_state_dict(prefix)`` returns a (nested) dict whose leaves are ``ShardedTensor``,
``ShardedObject``, ``ShardedTensorFactory``, ``LocalNonpersistentObject`` or plain values. Keys and
global shapes never depend on the parallel layout, so a checkpoint written under one layout can be
read under another: each rank asks for exactly the global slices it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.errors import CheckpointError

StateDict = dict[str, Any]
CommonStateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
ReplicaId = int | tuple[int, ...]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (0, or all zeros) is the copy that is written."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """What every sharded leaf has: a global ``key``, local ``data`` and a ``replica_id``."""

    key: str
    data: Any
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise ``CheckpointingException`` if the metadata fields contradict each other."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy with ``data=None`` (metadata only)."""


# positional parameters after (key, data): Megatron-Core's order (third argument a dtype) and ours
_MCORE_ORDER = (
    "dtype",
    "local_shape",
    "global_shape",
    "global_offset",
    "axis_fragmentations",
    "replica_id",
    "prepend_axis_num",
    "allow_shape_mismatch",
    "flattened_range",
)
_SHORT_ORDER = ("global_shape", "global_offset", "replica_id", "allow_shape_mismatch")


@dataclass(init=False)
class ShardedTensor(ShardedBase):
    """A local tensor ``data`` that is the block at ``global_offset`` of a global tensor.

    Two constructor forms: Megatron-Core's ``ShardedTensor(key, data, dtype, local_shape, global_shape,
    global_offset, axis_fragmentations, replica_id=0, prepend_axis_num=0, allow_shape_mismatch=False,
    flattened_range=None)`` and the short ``ShardedTensor(key, data, global_shape, global_offset,
    replica_id=0, allow_shape_mismatch=False)`` (dtype and local shape taken from ``data``); keywords
    work with both. Prefer ``from_rank_offsets``.

    Attributes:
        key: layout-independent global name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``.
        data: the local shard (None only in metadata-only copies).
        dtype, local_shape: of ``data``.
        global_shape: shape of the whole logical tensor.
        global_offset: element offset of the block along each global axis (prepended axes included).
        axis_fragmentations: number of equal chunks along each global axis when the shards form a
            regular grid (``from_rank_offsets``), else None.
        replica_id: which copy this is when several ranks hold the same shard; 0 (or all zeros) marks
            the main replica, the only one that is written.
        prepend_axis_num: leading global axes of size 1 per shard that ``data`` lacks (as if unsqueezed).
        allow_shape_mismatch: the saved global shape may differ on load (padded vocabularies); only the
            overlap is read.
        flattened_range: not supported (must be None), as in Megatron-Core 0.19.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __init__(self, key: str, data: torch.Tensor | None, *args: Any, **kwargs: Any) -> None:
        order = _MCORE_ORDER if args and isinstance(args[0], torch.dtype) else _SHORT_ORDER
        if len(args) > len(order):
            raise TypeError(f"ShardedTensor takes at most {len(order) + 2} positional arguments")
        given = dict(zip(order, args))
        unknown = set(kwargs) - set(_MCORE_ORDER)
        if unknown or set(given) & set(kwargs):
            raise TypeError(
                f"ShardedTensor: unknown or repeated arguments {sorted(unknown | (set(given) & set(kwargs)))}"
            )
        given.update(kwargs)
        if data is None and ("dtype" not in given or "local_shape" not in given):
            raise CheckpointingException(
                f"ShardedTensor {key}: with data=None, dtype and local_shape are required"
            )
        self.key, self.data = key, data
        self.dtype = given.get("dtype") or data.dtype  # type: ignore[union-attr]
        self.local_shape = tuple(given["local_shape"] if "local_shape" in given else data.shape)  # type: ignore[union-attr]
        self.global_shape = tuple(given["global_shape"])
        self.global_offset = tuple(given["global_offset"])
        frag = given.get("axis_fragmentations")
        self.axis_fragmentations = None if frag is None else tuple(frag)
        self.replica_id = given.get("replica_id", 0)
        self.prepend_axis_num = given.get("prepend_axis_num", 0)
        self.allow_shape_mismatch = given.get("allow_shape_mismatch", False)
        self.flattened_range = given.get("flattened_range")
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Raises ``CheckpointingException``: ``data``'s dtype or shape differs from the fields, the
        global shape, offset and (prepended) local shape disagree in length, a regular-grid offset is
        not a multiple of the local size, or ``flattened_range`` is set."""
        if self.flattened_range is not None:
            raise CheckpointingException(f"ShardedTensor {self.key}: flattened_range is not supported")
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"ShardedTensor {self.key}: data dtype {self.data.dtype} != {self.dtype}"
                )
            if tuple(self.data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"ShardedTensor {self.key}: data shape {tuple(self.data.shape)} != local_shape {self.local_shape}"
                )
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedTensor {self.key}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have the same number of axes"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"ShardedTensor {self.key}: local shape {self.local_shape} with prepend_axis_num="
                f"{self.prepend_axis_num} must have the {len(self.global_shape)} axes of global_shape"
            )
        if self.axis_fragmentations is not None:
            for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                if size and off % size:
                    raise CheckpointingException(
                        f"ShardedTensor {self.key}: offset {off} is not a multiple of the local size {size}"
                    )

    @property
    def has_regular_grid(self) -> bool:
        """The shards form a regular grid (``axis_fragmentations`` known)."""
        return self.axis_fragmentations is not None

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The local block's shape in global axes: ``local_shape`` with the prepended axes as 1."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of this block in the global tensor: ints for prepended axes, slices for the others."""
        p = self.prepend_axis_num
        return (
            *self.global_offset[:p],
            *(slice(off, off + size) for off, size in zip(self.global_offset[p:], self.local_shape)),
        )

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Position of this block in the grid of equal chunks (offset divided by the local size per axis)."""
        p = self.prepend_axis_num
        out = list(self.global_offset[:p])
        for off, size in zip(self.global_offset[p:], self.local_shape):
            if off % size:
                raise CheckpointingException(
                    f"ShardedTensor {self.key}: offset {off} not a multiple of {size}"
                )
            out.append(off // size)
        return tuple(out)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Chunk size along each axis of the regular grid (global size / fragments)."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(
                f"ShardedTensor {self.key}: no regular grid (axis_fragmentations=None)"
            )
        chunks = []
        for size, frag in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and size % frag:
                raise CheckpointingException(
                    f"ShardedTensor {self.key}: axis size {size} not divisible by {frag}"
                )
            chunks.append(size // frag)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    def local_data(self) -> torch.Tensor:
        """``data``, which saving (and loading, after ``init_data``) needs.

        Raises:
            CheckpointError: ``data`` is None (a tensor without data cannot be saved).
        """
        if self.data is None:
            raise CheckpointError(
                f"ShardedTensor {self.key} has no data (data=None); give it the local "
                "tensor, or call init_data() before loading into it"
            )
        return self.data

    def init_data(
        self, device: str | torch.device, init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocate ``data`` (``init_fn(local_shape, dtype=, device=)``) if it is None."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def validate(self) -> None:
        """Raises CheckpointError if the block does not lie inside the global shape."""
        for ax, (off, loc, glob) in enumerate(zip(self.global_offset, self.block_shape, self.global_shape)):
            if off < 0 or off + loc > glob:
                raise CheckpointError(
                    f"{self.key}: shard [{off}, {off + loc}) exceeds global size {glob} on axis {ax}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """A regular-grid shard from ``(axis, rank_along_axis, num_fragments)`` triples: along ``axis`` (a
        global axis, prepended ones included) the global tensor is ``num_fragments`` equal chunks and
        ``data`` is chunk ``rank_along_axis``. Axes not named are whole. ``init_kwargs`` go to the
        constructor (e.g. ``allow_shape_mismatch``).

        Raises:
            ConfigError: ``flattened_range`` given. CheckpointingException: an invalid triple.
        """
        if flattened_range is not None:
            raise ConfigError(
                f"ShardedTensor {key}: flattened_range is not supported (from_rank_offsets); pass None",
                params=("flattened_range",),
            )
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset, fragments = [0] * ndim, [1] * ndim
        for axis, rank, frag in rank_offsets:
            if not (0 <= axis < ndim and frag >= 1 and 0 <= rank < frag):
                raise CheckpointingException(f"ShardedTensor {key}: invalid rank offsets {rank_offsets}")
            global_shape[axis] *= frag
            global_offset[axis] = rank * (global_shape[axis] // frag)
            fragments[axis] = frag
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` of every rank's local tensor along ``dim`` (a local axis, prepended axes not
        counted): the global shape and offset along it shrink by ``length / local size``. One element.

        Raises:
            CheckpointingException: the shards along ``dim`` are not a regular grid of equal chunks.
        """
        assert self.data is not None, f"ShardedTensor {self.key}: narrow needs data"
        axis, local = dim + self.prepend_axis_num, self.local_shape[dim]
        glob, off = self.global_shape[axis], self.global_offset[axis]
        if glob % local or off % local or (glob * length) % local or (off * length) % local:
            raise CheckpointingException(
                f"ShardedTensor {self.key}: narrow needs a regular grid along axis {dim} "
                f"(global {glob}, offset {off}, local {local})"
            )
        new = self.data.narrow(dim, start, length)
        shape, offset = list(self.global_shape), list(self.global_offset)
        shape[axis], offset[axis] = glob * length // local, off * length // local
        return [
            replace(
                self,
                data=new,
                local_shape=tuple(new.shape),
                global_shape=tuple(shape),
                global_offset=tuple(offset),
            )
        ]


class LocalNonpersistentObject:
    """A value that is not saved: a save leaves it out, a load puts the local ``obj`` in its place."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


@dataclass
class ShardedObject(ShardedBase):
    """A picklable non-tensor value: shard ``global_offset`` of a grid ``global_shape`` of objects.

    ``ShardedObject(key, data, global_shape, global_offset, replica_id)`` as in Megatron-Core; the
    unique key of such a shard is ``{key}/shard_{offset}_{shape}`` (dot-joined). Ours also allows
    omitting the grid (one object per ``key``) and a keyword ``shard_key`` naming per-rank objects
    (unique key ``{key}/{shard_key}``). Objects cannot be resharded; each unique key has exactly one
    main replica (``replica_id`` 0), which writes it.
    """

    key: str
    data: Any
    global_shape: tuple[int, ...] = ()
    global_offset: tuple[int, ...] = ()
    replica_id: ReplicaId = 0
    shard_key: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        self.global_shape, self.global_offset = tuple(self.global_shape), tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have the same number of axes"
            )

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """The name this object is stored under."""
        if self.shard_key:
            return f"{self.key}/{self.shard_key}"
        if self.global_shape:
            offset, shape = ".".join(map(str, self.global_offset)), ".".join(map(str, self.global_shape))
            return f"{self.key}/shard_{offset}_{shape}"
        return self.key

    @property
    def num_shards(self) -> int:
        """How many shards (unique keys) the object ``key`` consists of."""
        n = 1
        for s in self.global_shape:
            n *= s
        return n

    def __str__(self) -> str:
        return f"ShardedObject(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The data-less object that a stored unique key names (Megatron's ``key/shard_O_S`` form or ours)."""
        key, sep, rest = unique_key.rpartition("/")
        if not sep:
            return cls(unique_key, None, replica_id=replica_id)
        parts = rest.split("_")
        if len(parts) == 3 and parts[0] == "shard":
            try:
                offset = tuple(int(x) for x in parts[1].split("."))
                shape = tuple(int(x) for x in parts[2].split("."))
                return cls(key, None, shape, offset, replica_id)
            except ValueError:
                pass
        return cls(key, None, replica_id=replica_id, shard_key=rest)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as the sub-state-dict ``build_fn(key, data, replica_id, flattened_range)`` builds
    (sharded leaves of its own) and rebuilt on load by ``merge_fn(loaded sub-state-dict)``.

    ``save`` replaces it by what ``build_fn`` returns; ``load`` builds the same request, loads it and
    puts ``merge_fn``'s result in the factory's place.
    """

    key: str
    data: torch.Tensor | None
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """The sub-state-dict to save or load in place of this factory."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)  # type: ignore[arg-type]

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before ``build``."""

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory of ``sharded_state_dict`` by what it builds, in place."""
    dict_list_map_inplace(
        lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict
    )


def apply_factory_merges(x1: Any, x2: Any, key: tuple = ()) -> Any:
    """Where ``x2`` (the factories, same nesting; lists may be dicts keyed by index) holds a
    ShardedTensorFactory, replace the loaded sub-state-dict of ``x1`` by the factory's ``merge_fn`` of
    it; in place, returns ``x1``.

    Raises:
        CheckpointError: the nestings differ (naming the key path).
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x2, dict) and isinstance(x1, dict | list):
        for k, v2 in x2.items():
            if (
                isinstance(x1, dict)
                and k not in x1
                or isinstance(x1, list)
                and not (isinstance(k, int) and 0 <= k < len(x1))
            ):
                raise CheckpointError(
                    f"apply_factory_merges: key {k!r} at {key} is not in the loaded state dict"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointError(f"apply_factory_merges: lists of lengths {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
        return x1
    raise CheckpointError(
        f"apply_factory_merges: cannot merge {type(x1).__name__} with {type(x2).__name__} at {key}"
    )
