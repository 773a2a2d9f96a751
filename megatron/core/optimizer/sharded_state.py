"""Optimizer state as ShardedTensors that mirror the model's sharding.

For each optimized param, the model's sharded state dict holds a ``ShardedTensor`` whose ``data`` is
that very param. Each per-param state tensor (``fp32_param`` for bf16/fp16 params, ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) becomes a ShardedTensor keyed
``optimizer.state.<kind>.<model key>`` with the model param's global shape, offset and replica id,
so the optimizer state reshards exactly like the weights. Everything else (group hyper-parameters,
step counts, loss-scaler state) is one ``ShardedObject`` keyed ``optimizer.common``.

Layout of the dict::

    {"param_state": {<model key>: {<kind>: ShardedTensor}}, "common": ShardedObject}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
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


def _model_tensors(opt: MegatronOptimizer, model_sd: dict) -> list[ShardedTensor]:
    """The model ShardedTensor of each optimized param, matched by identity (or storage and view)."""
    found: list[ShardedTensor] = []
    _collect(model_sd, found)
    by_id = {id(st.data): st for st in found}
    # A model shard may be a reshaped view of its param (SwiGLU's fc1 is stored as [2, F, h]).
    by_view = {(d.data_ptr(), d.numel(), d.dtype): st for st in found for d in (st.local_data(),)}
    result = []
    for p in opt.model_params:
        st = by_id.get(id(p)) or by_view.get((p.data_ptr(), p.numel(), p.dtype))
        if st is None:
            raise CheckpointError(
                f"a trainable param of shape {tuple(p.shape)} has no ShardedTensor in the model's sharded "
                "state dict, so its optimizer state could not be checkpointed"
            )
        result.append(st)
    return result


def param_keys(opt: MegatronOptimizer, model_sd: dict) -> list[str]:
    """The model's global key of each optimized param, in ``opt.model_params`` order."""
    return [st.key for st in _model_tensors(opt, model_sd)]


def _like(st: ShardedTensor, kind: str, data: torch.Tensor, owner_writes: bool = False) -> ShardedTensor:
    """``data`` sharded like the model tensor ``st``. ``owner_writes`` (distributed optimizer): the
    state exists only on the param's owner, so the data-parallel part of the replica id (its last
    entry) is 0 there; the other entries (tensor-parallel copies, tied-embedding copies) still decide."""
    rid = st.replica_id
    if owner_writes:
        rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0
    return ShardedTensor(
        key=f"optimizer.state.{kind}.{st.key}",
        data=data.view(st.local_data().shape),
        global_shape=st.global_shape,
        global_offset=st.global_offset,
        replica_id=rid,
        allow_shape_mismatch=st.allow_shape_mismatch,
    )


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


def build(
    opt: MegatronOptimizer, model_sd: dict, common_replica_id: int = 0
) -> tuple[dict[str, Any], list[str]]:
    """The sharded state dict of ``opt`` and the model key of each param (see module docstring)."""
    opt.init_state()
    tensors = _model_tensors(opt, model_sd)
    owner_writes = opt.param_sync is not None
    param_state: dict[str, dict[str, ShardedTensor]] = {}
    for model_p, main_p, st in zip(opt.model_params, opt.main_params, tensors):
        entry = {}
        if main_p is not model_p:
            entry["fp32_param"] = _like(st, "fp32_param", main_p, owner_writes)
        for kind, value in opt.optimizer.state[main_p].items():
            if kind != "step" and torch.is_tensor(value) and value.shape == main_p.shape:
                entry[kind] = _like(st, kind, value, owner_writes)
        param_state[st.key] = entry
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
    return sharded, [st.key for st in tensors]


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
def apply(opt: MegatronOptimizer, loaded: dict[str, Any], keys: list[str]) -> None:
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
    for model_p, main_p, key in zip(opt.model_params, opt.main_params, keys):
        if key not in param_state:
            raise CheckpointError(f"optimizer state for {key} is missing from the loaded checkpoint")
        entry = param_state[key]
        state = opt.optimizer.state[main_p]
        for kind, value in entry.items():
            value = value.local_data() if isinstance(value, ShardedTensor) else value
            if kind == "fp32_param":
                if main_p is not model_p:
                    main_p.copy_(value.reshape(main_p.shape))
            elif kind in state:
                state[kind].copy_(value.reshape(state[kind].shape))
        if main_p is not model_p and "fp32_param" not in entry:
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
