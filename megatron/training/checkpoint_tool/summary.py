"""What a checkpoint holds, read from its ``.metadata`` and common state without reading a tensor, and
every integrity problem found instead of the first: ``inspect``'s content, shared with ``diff``.

Components (``dist_checkpointing.consistency.component``): ``model``, ``optimizer``, and ``other``
(RNG states, FP8 scaling state, the common state). A tensor's bytes are its global element count times
its element size; an object's are its bytes on disk.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.dist_checkpointing.consistency import (
    COMMON_STATE_KEY,
    component,
    contents_problems,
)
from megatron.core.dist_checkpointing.files import checkpoint_problems, read_metadata_json
from megatron.core.dist_checkpointing.torch_dist import dcp_load, read_dcp_metadata
from megatron.training.checkpoint_tool.reader import find_checkpoint

GROUPS = ("model", "optimizer", "other")  # the per-component byte totals
LAYOUT_KEYS = (
    "world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "data_parallel_size",
    "sequence_parallel",
    "use_distributed_optimizer",
    "use_torch_fsdp2",
)
# args["config"] (section, field) of each layout entry, for checkpoints saved before args["layout"]
_LAYOUT_FROM_CONFIG = {
    "world_size": ("training", "world_size"),
    "tensor_model_parallel_size": ("model", "tensor_model_parallel_size"),
    "pipeline_model_parallel_size": ("model", "pipeline_model_parallel_size"),
    "virtual_pipeline_model_parallel_size": ("model", "virtual_pipeline_model_parallel_size"),
    "sequence_parallel": ("model", "sequence_parallel"),
    "use_distributed_optimizer": ("ddp", "use_distributed_optimizer"),
    "use_torch_fsdp2": ("ddp", "use_torch_fsdp2"),
}
_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.(.+)$")
_DAMAGED = ": the checkpoint is damaged"


def group_of(key: str) -> str:
    """The group ``key`` is listed under: a byte-total group of ``GROUPS``."""
    c = component(key)
    return c if c in ("model", "optimizer") else "other"


def table_heading(key: str) -> tuple[str, str]:
    """(heading, name under it) of a tensor in inspect's table: one heading per transformer layer,
    top-level module or optimizer state kind (``optimizer.state.exp_avg``)."""
    c = component(key)
    if c == "optimizer":
        parts = key.split(".")
        cut = 3 if len(parts) > 3 and parts[1] == "state" else 2
        return ".".join(parts[:cut]), ".".join(parts[cut:]) or key
    m = _LAYER.match(key)
    head, name = (m.group(1), m.group(2)) if m else (key.split(".")[0], ".".join(key.split(".")[1:]) or key)
    return (f"fp8 {head}" if c == "fp8" else head), name


@dataclass
class Summary:
    """One checkpoint as inspect reports it (``to_json`` documents the keys)."""

    dir: str
    iteration: int | None
    format: dict[str, Any]
    common: dict[str, Any]
    tensors: list[dict[str, Any]] = field(default_factory=list)
    objects: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def args(self) -> dict[str, Any]:
        return self.common.get("args") or {}

    def shape_flags(self) -> dict[str, Any]:
        """The top-level saved args (the flags that fix tensor shapes), by field name."""
        return {k: v for k, v in self.args.items() if k not in ("config", "layout")}

    def layout(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the parallel layout it was saved under, where it was read: ``args.layout`` or
        ``args.config`` for checkpoints older than the record; None where neither holds it)."""
        if isinstance(self.args.get("layout"), dict):
            return dict(self.args["layout"]), "args.layout"
        config = self.args.get("config")
        if not isinstance(config, dict):
            return None, None
        out = {k: (config.get(s) or {}).get(f) for k, (s, f) in _LAYOUT_FROM_CONFIG.items()}
        out["data_parallel_size"] = None  # not recorded before args["layout"]
        return {k: out.get(k) for k in LAYOUT_KEYS}, "args.config"

    def bytes_by_group(self) -> dict[str, int]:
        totals = dict.fromkeys(GROUPS, 0)
        for row in self.tensors + self.objects:
            totals[row["group"]] += row["bytes"]
        return totals

    def to_json(self) -> dict[str, Any]:
        """inspect --json: dir, iteration, format (metadata.json), checkpoint_version, consumed_train_samples,
        consumed_valid_samples, floating_point_operations, finite (bool, or None when not recorded),
        contents, shape_flags {field: value}, layout {...} and layout_source, bytes {total, model,
        optimizer, other}, files {name: bytes on disk}, tensors [{key, group, component, shape, dtype,
        bytes}], objects [{key, group, component, bytes}], problems [one line each]."""
        layout, source = self.layout()
        c = self.common
        totals = self.bytes_by_group()
        return {
            "dir": self.dir,
            "iteration": c.get("iteration", self.iteration),
            "format": self.format,
            "checkpoint_version": c.get("checkpoint_version"),
            "consumed_train_samples": c.get("consumed_train_samples"),
            "consumed_valid_samples": c.get("consumed_valid_samples"),
            "floating_point_operations": c.get("num_floating_point_operations_so_far"),
            "finite": c.get("finite"),
            "contents": c.get("checkpoint_contents"),
            "shape_flags": self.shape_flags(),
            "layout": layout,
            "layout_source": source,
            "bytes": {"total": sum(totals.values()), **totals},
            "files": self.files,
            "tensors": self.tensors,
            "objects": self.objects,
            "problems": self.problems,
        }


def summarize(path: str, ckpt_step: int | None = None) -> Summary:
    """The Summary of the checkpoint ``path`` names (``reader.find_checkpoint``'s rules), with every
    problem of its files, ``.metadata`` and common state listed instead of raised.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint of our format (no metadata.json).
    """
    ckpt_dir, iteration = find_checkpoint(path, ckpt_step)
    s = Summary(ckpt_dir, iteration, read_metadata_json(ckpt_dir), {})
    s.files = {n: os.path.getsize(os.path.join(ckpt_dir, n)) for n in sorted(os.listdir(ckpt_dir))}
    try:
        md = read_dcp_metadata(ckpt_dir)
    except CheckpointError as e:
        s.problems.append(str(e).removesuffix(_DAMAGED))
        return s
    s.problems += checkpoint_problems(ckpt_dir, md)
    s.common = _read_common(ckpt_dir, md, s.problems)
    s.tensors, s.objects = _rows(md)
    return s


def _read_common(ckpt_dir: str, md: Any, problems: list[str]) -> dict[str, Any]:
    """The common state (empty where it cannot be read); appends what is wrong with it to ``problems``."""
    if COMMON_STATE_KEY not in md.state_dict_metadata:
        problems.append(
            f"{os.path.join(ckpt_dir, '.metadata')} holds no {COMMON_STATE_KEY} (iteration, args, ...)"
        )
        return {}
    if checkpoint_problems(ckpt_dir, md, {COMMON_STATE_KEY}):
        return {}  # its file is listed among the problems already
    try:
        common = dcp_load({}, [COMMON_STATE_KEY], ckpt_dir, no_dist=True)[COMMON_STATE_KEY]
    except (CheckpointError, RuntimeError) as e:  # DCP reports an unpicklable object as a RuntimeError
        problems.append(f"the common state ({COMMON_STATE_KEY}) cannot be read: {str(e).splitlines()[0]}")
        return {}
    problems += contents_problems(ckpt_dir, md, common)
    return common


def _rows(md: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(a row per tensor, a row per object) of ``.metadata``, sorted by key."""
    on_disk: dict[str, int] = {}
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        on_disk[index.fqn] = on_disk.get(index.fqn, 0) + info.length
    tensors, objects = [], []
    for key, item in sorted(md.state_dict_metadata.items()):
        if not isinstance(item, TensorStorageMetadata):
            c = component(key, is_tensor=False)
            group = "optimizer" if c == "optimizer" else "other"
            objects.append({"key": key, "group": group, "component": c, "bytes": on_disk.get(key, 0)})
            continue
        dtype = item.properties.dtype
        tensors.append(
            {
                "key": key,
                "group": group_of(key),
                "component": component(key),
                "shape": list(item.size),
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": math.prod(item.size) * dtype.itemsize,
            }
        )
    return tensors, objects
