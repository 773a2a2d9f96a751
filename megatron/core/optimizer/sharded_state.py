"""Optimizer state as ShardedTensors that mirror the model's sharding.

Each optimized tensor ``t`` (an entry of ``model_params``) is matched by address to the model's
ShardedTensors: those whose data lie inside ``t``'s storage (``t`` is the param itself, or a local
shard that holds several blocks of it, as under FSDP2), or else the one whose data hold ``t`` (a
distributed-optimizer piece: a flat range of one param). Each per-tensor state (``fp32_param`` for
bf16/fp16 params, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) is cut into the same blocks by
flat offset (a piece's range as rectangles, ``flat_range_blocks``) and becomes ShardedTensors keyed
``optimizer.state.<kind>.<model key>`` with the model tensor's global shape, offsets and replica id,
so the optimizer state reshards exactly like the weights, across optimizers and data-parallel sizes.
Everything else (group hyper-parameters, step counts, loss-scaler state) is one ``ShardedObject``
keyed ``optimizer.common``.

Layout of the dict::

    {"param_state": {<block name>: {<kind>: ShardedTensor}}, "common": ShardedObject}

A block's name is its model key; a second block of the same key on this rank is ``<key>#1``, etc.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.flat_ranges import flat_range_blocks
from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedObject, ShardedTensor
from megatron.core.optimizer.optimizer_config import OptimizerConfig

if TYPE_CHECKING:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

COMMON_KEY = "optimizer.common"
# The names get_param_groups gives its groups (weight decay or not, --decoupled-lr or not).
PARAM_GROUP_NAMES = ("decay", "no_decay", "decoupled_decay", "decoupled_no_decay")
# Group entries restored from a checkpoint; the rest comes from this run's config.
_RESTORED_GROUP_KEYS = ("lr", "weight_decay")


def init_state(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
    """Give every param the state torch would create at its first step (zeros, step 0)."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) > 0:
                continue
            if config.optimizer == "adam":
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif config.optimizer == "sgd" and group.get("momentum", 0.0) != 0.0:
                # buf = momentum * 0 + grad equals torch's clone(grad) at the first step.
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _collect(obj: Any, out: list[ShardedTensor]) -> None:
    if isinstance(obj, ShardedTensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


@dataclass(frozen=True)
class _Match:
    """Elements [start, stop) of model ShardedTensor ``st``'s (flat, row-major) data are the elements
    from ``offset`` on of an optimized tensor: all of ``st`` when ``st`` lies inside it (the param
    itself, or one of several blocks a local shard holds, as under FSDP2), a range of ``st`` when the
    optimized tensor is a flat piece of a param (the distributed optimizer)."""

    st: ShardedTensor
    start: int
    stop: int
    offset: int


def _matches(opt: MegatronOptimizer, model_sd: dict) -> list[list[_Match]]:
    """For each optimized tensor (``opt.model_params``), the model ShardedTensors sharing its storage
    (by address), in the optimized tensor's flat order.

    Raises:
        CheckpointError: an optimized tensor shares storage with no model ShardedTensor.
    """
    found: list[ShardedTensor] = []
    _collect(model_sd, found)
    tensors: dict[tuple[int, int, torch.dtype], ShardedTensor] = {}
    for st in found:  # a tensor listed twice (a tied weight) is matched once, under its first key
        d = st.local_data()
        if d.is_contiguous() and d.numel() > 0:
            tensors.setdefault((d.data_ptr(), d.numel(), d.dtype), st)
    result = []
    for t in opt.model_params:
        size, lo = t.element_size(), t.data_ptr()
        hi = lo + t.numel() * size
        matches = []
        for (ptr, numel, dtype), st in tensors.items():
            first, last = max(lo, ptr), min(hi, ptr + numel * size)
            if dtype == t.dtype and first < last:
                start, stop = (first - ptr) // size, (last - ptr) // size
                matches.append(_Match(st, start, stop, (first - lo) // size))
        if not matches:
            raise CheckpointError(
                f"a trainable param of shape {tuple(t.shape)} has no ShardedTensor in the model's sharded "
                "state dict, so its optimizer state could not be checkpointed"
            )
        result.append(sorted(matches, key=lambda m: m.offset))
    return result


def _replica_id(st: ShardedTensor, owner_writes: bool) -> ReplicaId:
    """``st``'s replica id. ``owner_writes`` (distributed optimizer): the state exists only on the
    rank that owns it, so the data-parallel part of the replica id (its last entry) is 0 there; the
    other entries (tensor-parallel copies, tied-embedding copies) still decide."""
    rid = st.replica_id
    if owner_writes:
        rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0
    return rid


def _blocks(match: _Match, kind: str, flat: torch.Tensor, owner_writes: bool) -> list[ShardedTensor]:
    """The part of state ``flat`` (1-D, as long as the optimized tensor) that ``match`` covers, as
    ShardedTensors keyed ``optimizer.state.<kind>.<model key>`` placed like the model tensor."""
    st, key = match.st, f"optimizer.state.{kind}.{match.st.key}"
    rid = _replica_id(st, owner_writes)
    data = flat[match.offset : match.offset + match.stop - match.start]
    if match.start == 0 and match.stop == st.local_data().numel():
        data = data.view(st.local_data().shape)
        return [replace(st, key=key, data=data, dtype=data.dtype, replica_id=rid)]
    return flat_range_blocks(st, data, match.start, match.stop, key=key, replica_id=rid)


@dataclass(frozen=True)
class Plan:
    """Where each optimized tensor's state goes in the sharded dict: per tensor, ``(name, start,
    stop)`` for each block, ``name`` being the block's entry in ``param_state`` and [start, stop) its
    flat range within the tensor."""

    blocks: list[list[tuple[str, int, int]]]

    def keys(self) -> list[str]:
        """The first entry name of each optimized tensor (its model key)."""
        return [b[0][0] for b in self.blocks]


def _layout(opt: MegatronOptimizer, model_sd: dict) -> tuple[list[list[_Match]], Plan]:
    matches = _matches(opt, model_sd)
    names: dict[str, int] = {}
    plan = []
    for t, tensor_matches in zip(opt.model_params, matches):
        flat = t.detach().view(-1)
        entries = []
        for m in tensor_matches:
            for block in _blocks(m, "fp32_param", flat, owner_writes=False):
                start = (block.local_data().data_ptr() - flat.data_ptr()) // flat.element_size()
                seen = names.get(m.st.key, 0)
                names[m.st.key] = seen + 1
                name = m.st.key if seen == 0 else f"{m.st.key}#{seen}"
                entries.append((name, start, start + block.local_data().numel()))
        plan.append(entries)
    return matches, Plan(plan)


def param_keys(opt: MegatronOptimizer, model_sd: dict) -> Plan:
    """Where each optimized param's state goes (:class:`Plan`), in ``opt.model_params`` order."""
    return _layout(opt, model_sd)[1]


def _group_step(opt: MegatronOptimizer, group: dict[str, Any]) -> float | None:
    for p in group["params"]:
        step = opt.optimizer.state.get(p, {}).get("step")
        if step is not None:
            return float(step)
    return None


def _agree_on_steps(opt: MegatronOptimizer, groups: dict[str, dict[str, Any]]) -> None:
    """Distributed optimizer: the writer of ``optimizer.common`` may own no param of some group, so
    take each group's step count as the maximum over all ranks (a collective; save is one too).
    Every rank reduces the same list of names: pipeline stages without embedding or output layer
    have no --decoupled-lr groups."""
    names = sorted(set(groups) | set(PARAM_GROUP_NAMES))
    steps = torch.tensor(
        [groups[n]["step"] if n in groups and groups[n]["step"] is not None else -1.0 for n in names],
        dtype=torch.float64,
        device=opt.device,
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    for name, step in zip(names, steps.tolist()):
        if name in groups:
            groups[name]["step"] = step if step >= 0 else None


def build(opt: MegatronOptimizer, model_sd: dict, common_replica_id: int = 0) -> tuple[dict[str, Any], Plan]:
    """The sharded state dict of ``opt`` and where each param's state lies in it (see module docstring)."""
    opt.init_state()
    matches, plan = _layout(opt, model_sd)
    owner_writes = opt.param_sync is not None
    param_state: dict[str, dict[str, ShardedTensor]] = {}
    for model_p, main_p, tensor_matches, entries in zip(
        opt.model_params, opt.main_params, matches, plan.blocks
    ):
        kinds: dict[str, torch.Tensor] = {}
        if main_p.dtype != model_p.dtype:  # an fp32 param offloaded to the host has no fp32 copy
            kinds["fp32_param"] = main_p
        for kind, value in opt.optimizer.state[main_p].items():
            if kind != "step" and torch.is_tensor(value) and value.shape == main_p.shape:
                kinds[kind] = value
        for kind, value in kinds.items():
            blocks = [b for m in tensor_matches for b in _blocks(m, kind, value.view(-1), owner_writes)]
            assert len(blocks) == len(entries), "every state tensor is cut like the param"
            for (name, _, _), block in zip(entries, blocks):
                param_state.setdefault(name, {})[kind] = block
        for name, _, _ in entries:
            param_state.setdefault(name, {})
    groups = {}
    for group in opt.optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["step"] = _group_step(opt, group)
        groups[group["name"]] = hyper
    if owner_writes:
        _agree_on_steps(opt, groups)
    common = {
        "optimizer": opt.config.optimizer,
        "param_groups": groups,
        "grad_scaler": opt.grad_scaler.state_dict() if opt.grad_scaler is not None else None,
    }
    sharded = {
        "param_state": param_state,
        "common": ShardedObject(COMMON_KEY, common, replica_id=common_replica_id),
    }
    return sharded, plan


def _saved_group(saved_groups: dict[str, Any], name: str) -> dict[str, Any]:
    """The checkpoint's group ``name``. A ``decoupled_*`` group (--decoupled-lr) missing from a
    checkpoint saved without --decoupled-lr takes the group its params were in (same step count)."""
    saved = saved_groups.get(name)
    if saved is None and name.startswith("decoupled_"):
        saved = saved_groups.get(name[len("decoupled_") :])
    if saved is None:
        raise CheckpointError(f"param group {name!r} is missing from the loaded optimizer state")
    return saved


@torch.no_grad()
def apply(opt: MegatronOptimizer, loaded: dict[str, Any], plan: Plan) -> None:
    """Copy loaded tensors into the optimizer state; set steps, lr/wd and the loss scaler.

    Raises:
        CheckpointError: a param's state is missing, or the checkpoint holds another optimizer's state.
    """
    opt.init_state()
    common = loaded["common"]
    if isinstance(common, ShardedObject):
        common = common.data
    if common.get("optimizer") != opt.config.optimizer:
        raise CheckpointError(
            f"the checkpoint's optimizer state is for optimizer {common.get('optimizer')!r}, "
            f"this run's optimizer is {opt.config.optimizer!r}"
        )
    param_state = loaded["param_state"]
    for model_p, main_p, entries in zip(opt.model_params, opt.main_params, plan.blocks):
        state = opt.optimizer.state[main_p]
        has_main = True
        for name, start, stop in entries:
            if name not in param_state:
                raise CheckpointError(f"optimizer state for {name} is missing from the loaded checkpoint")
            entry = param_state[name]
            has_main = has_main and "fp32_param" in entry
            for kind, value in entry.items():
                value = value.local_data() if isinstance(value, ShardedTensor) else value
                if kind == "fp32_param":
                    target = main_p if main_p is not model_p else None
                else:
                    target = state.get(kind)
                if target is not None:
                    target.view(-1)[start:stop].copy_(value.reshape(-1))
        if main_p is not model_p and not has_main:
            main_p.copy_(model_p)  # saved from a run without main copies: start from the weights
    for group in opt.optimizer.param_groups:
        saved = _saved_group(common["param_groups"], group["name"])
        for k in _RESTORED_GROUP_KEYS:
            if k in saved:
                group[k] = saved[k]
        if saved.get("step") is not None:
            for p in group["params"]:
                if "step" in opt.optimizer.state[p]:
                    opt.optimizer.state[p]["step"].fill_(saved["step"])
    if opt.grad_scaler is not None and common.get("grad_scaler") is not None:
        opt.grad_scaler.load_state_dict(common["grad_scaler"])
