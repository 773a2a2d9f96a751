"""Optimizers: fp32 main params, loss scaling, gradient clipping, param groups.

``get_megatron_optimizer`` is the entry point: it splits the params into weight-decay groups, picks
the loss scaler from the precision flags and wraps a torch AdamW/SGD in :class:`MegatronOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.config_utils import ConfigError
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.optimizer.chained import ChainedOptimizer
from megatron.core.optimizer.clip_grads import param_is_not_duplicate
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.sharded_state import PARAM_GROUP_NAMES

__all__ = [
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "OptimizerConfig",
    "get_megatron_optimizer",
    "get_param_groups",
    "is_embedding_or_output_parameter",
    "param_is_not_duplicate",
]

NoWeightDecayCond = Callable[[str, torch.nn.Parameter], bool]


def _default_no_wd(name: str, param: torch.nn.Parameter) -> bool:
    return name.endswith(".bias") or param.dim() == 1


# The weights --decoupled-lr applies to (Megatron's ``is_embedding_or_output_parameter``): the word
# embedding and the output layer, whose last-stage copy of a tied embedding is also named output_layer.
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output_parameter(name: str, param: torch.nn.Parameter) -> bool:
    """True for the input embedding and output layer weights (or a param tagged
    ``is_embedding_or_output_parameter``, as Megatron-Core models tag them)."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False)) or name.endswith(
        _EMBEDDING_OR_OUTPUT
    )


def get_param_groups(
    model_chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: NoWeightDecayCond | None = None,
) -> list[dict[str, Any]]:
    """Split trainable params into weight-decay and no-weight-decay groups.

    Biases and 1-D params (norm weights) get ``wd_mult = 0.0``; the rest ``wd_mult = 1.0``; every
    group ``lr_mult = 1.0``. With ``config.decoupled_lr`` the embedding and output layer weights
    (:func:`is_embedding_or_output_parameter`) form groups of their own with ``is_decoupled_lr`` and
    ``max_lr`` / ``min_lr`` = ``decoupled_lr`` / ``decoupled_min_lr`` (default ``min_lr``), which
    :class:`OptimizerParamScheduler` follows. A param shared by several chunks is listed once. Empty
    groups are dropped. Group names (``decay``, ``no_decay``, ``decoupled_decay``,
    ``decoupled_no_decay``) identify groups in checkpoints.
    """
    no_wd = no_weight_decay_cond or _default_no_wd
    lr = config.lr if config.lr is not None else 0.0
    decoupled = config.decoupled_lr is not None
    buckets: dict[str, list[torch.nn.Parameter]] = {n: [] for n, *_ in _GROUPS}
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            kind = "no_decay" if no_wd(name, param) else "decay"
            if decoupled and is_embedding_or_output_parameter(name, param):
                kind = "decoupled_" + kind
            buckets[kind].append(param)
    groups = []
    for name, wd_mult, is_decoupled in _GROUPS:
        if not buckets[name]:
            continue
        group = {
            "params": buckets[name],
            "name": name,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_decoupled_lr": is_decoupled,
            "lr": lr,
            "weight_decay": config.weight_decay * wd_mult,
        }
        if is_decoupled:
            group["max_lr"] = config.decoupled_lr
            group["min_lr"] = (
                config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr
            )
            group["lr"] = config.decoupled_lr
        groups.append(group)
    return groups


# (name, wd_mult, is_decoupled_lr) of each param group, in the optimizer's order.
_GROUPS = (
    ("decay", 1.0, False),
    ("no_decay", 0.0, False),
    ("decoupled_decay", 1.0, True),
    ("decoupled_no_decay", 0.0, True),
)
assert (
    tuple(name for name, *_ in _GROUPS) == PARAM_GROUP_NAMES
)  # the distributed optimizer's checkpoint relies on it


def _make_grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: list[torch.nn.Module],
    config_overrides: dict | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | None = None,
    *,
    grad_stats_group: dist.ProcessGroup | None = None,
    tp_rank: int | None = None,
    no_weight_decay_cond: NoWeightDecayCond | None = None,
) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (the model, or its virtual-pipeline chunks), with
    Megatron-Core's signature.

    bf16/fp16 params get fp32 main copies; fp32 params are updated in place. fp16 uses a dynamic
    loss scaler unless ``config.loss_scale`` fixes one (as in Megatron, an explicit
    ``--loss-scale`` also applies with bf16); bf16 and fp32 otherwise run unscaled. A model whose
    DDP wrapper shards the optimizer (``use_distributed_optimizer``) gets a
    :class:`DistributedOptimizer`.

    Args:
        config: the optimizer settings.
        model_chunks: modules whose trainable params are optimized.
        config_overrides: Megatron-Core's per-parameter config overrides; only None (its standard
            ones, which are this package's groups: no weight decay for biases and 1-D params,
            ``decoupled_lr`` for the embedding and output layer) is built.
        use_gloo_process_groups: accepted, no effect (no gloo side groups are made).
        pg_collection: Megatron-Core's ``ProcessGroupCollection``; its ``mp`` group reduces the grad
            statistics and its ``tp`` rank picks the duplicates. Default: the groups of
            ``parallel_state.initialize_model_parallel`` when initialized, else none (one process).
        dump_param_to_param_group_map: only None is built.
        grad_stats_group: (ours) the group for grad norm, zero count and overflow flag; overrides
            ``pg_collection``. With expert parameters (DDP chunks of a model with
            ``num_moe_experts``, no distributed optimizer) the world, each gradient counted on its
            first data-parallel replica (dp x cp for dense params, expert-dp for expert ones).
        tp_rank: (ours) tensor-parallel rank; TP-replicated params count in the grad norm only on rank 0.
        no_weight_decay_cond: (ours) ``(name, param) -> bool``, True for params without weight decay;
            default: biases and 1-D params.

    Raises:
        ConfigError: conflicting precision settings, no trainable params, or an option not built.
    """
    if config_overrides:
        raise ConfigError(
            "get_megatron_optimizer(config_overrides=...) is not supported: per-parameter overrides "
            "are not built; pass None (biases and 1-D params get no weight decay, "
            "OptimizerConfig.decoupled_lr sets the embedding's) or no_weight_decay_cond=",
            params=("config_overrides",),
        )
    if dump_param_to_param_group_map is not None:
        raise ConfigError(
            "get_megatron_optimizer(dump_param_to_param_group_map=...) is not supported; pass None",
            params=("dump_param_to_param_group_map",),
        )
    grad_stats_group, tp_rank = _stats_groups(grad_stats_group, tp_rank, pg_collection)
    if config.fp16 and config.bf16:
        raise ConfigError("fp16 and bf16 are mutually exclusive; set at most one", params=("fp16", "bf16"))
    if config.loss_scale is not None and not (config.fp16 or config.bf16):
        raise ConfigError(
            "loss_scale has no effect without fp16 or bf16; drop loss_scale or pick a precision",
            params=("loss_scale", "fp16", "bf16"),
        )
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    groups = get_param_groups(model_chunks, config, no_weight_decay_cond)
    if not groups:
        raise ConfigError(
            "model_chunks have no trainable parameters (requires_grad=True) to optimize",
            params=("model_chunks",),
        )
    sharded = [c for c in model_chunks if isinstance(c, DistributedDataParallel) and c.distributed_optimizer]
    if not sharded:
        replicas = (0, 0)
        if _has_experts(model_chunks):
            # Expert shards differ along ep, which the model-parallel group does not span: sum over
            # the world, each gradient counted on its first data-parallel replica only.
            pg: parallel_state.ParallelState = model_chunks[0].pg  # type: ignore[assignment]
            grad_stats_group, replicas = dist.group.WORLD, (pg.dp_cp_rank, pg.expt_dp_rank)
        return MegatronOptimizer(
            config, groups, _make_grad_scaler(config), grad_stats_group, tp_rank, replica_ranks=replicas
        )
    # Distributed optimizer: this rank optimizes its slice of every gradient bucket and all-gathers
    # the updated params afterwards; grad statistics sum over every rank (each element owned once).
    assert len(sharded) == len(model_chunks), "every chunk of one model has the same DDP config"
    return DistributedOptimizer(config, groups, _make_grad_scaler(config), sharded, tp_rank)


def _has_experts(model_chunks: list[torch.nn.Module]) -> bool:
    """Whether DDP-wrapped ``model_chunks`` belong to a model with expert parameters on some pipeline
    stage (its config's ``num_moe_experts``: the same answer, and collectives, on every rank), in a
    multi-rank run."""
    if not all(isinstance(c, DistributedDataParallel) for c in model_chunks):
        return False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    return any(getattr(c.config, "num_moe_experts", None) for c in model_chunks)


def _stats_groups(
    group: dist.ProcessGroup | None, tp_rank: int | None, pg_collection: Any
) -> tuple[dist.ProcessGroup | None, int]:
    """(group reducing the grad statistics, tp rank): the given ones, else ``pg_collection``'s, else
    the default parallel state's where one is initialized (a public entry point may read it)."""
    if group is None and pg_collection is not None:
        group = getattr(pg_collection, "mp", None)
        tp = getattr(pg_collection, "tp", None)
        if tp_rank is None and tp is not None and dist.is_initialized():
            tp_rank = dist.get_rank(tp)
    if group is None and pg_collection is None and tp_rank is None:
        if parallel_state.model_parallel_is_initialized():
            state = parallel_state.get_parallel_state()
            group, tp_rank = state.mp_group, state.tp_rank
    return group, tp_rank or 0
