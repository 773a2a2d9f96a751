"""Fully sharded data parallelism on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

``TorchFullyShardedDataParallel`` wraps one model chunk as ``DistributedDataParallel`` does and
offers what the schedules, ``finalize_model_grads``, the optimizer and the checkpoint code call on
it. ``fully_shard`` runs on every ``TransformerLayer`` (one all-gather / reduce-scatter unit each)
and on the chunk root (embedding, final norm, output layer), over a 1-D ``DeviceMesh`` built from
this rank's data-parallel group: tensor parallelism stays ours, so what FSDP2 shards on dim 0 is
each rank's local tensor-parallel shard, and pipeline stages shard over their own dp group.

Parameters. Sharded parameters are kept in fp32 (the optimizer's main parameters, updated in
place); ``MixedPrecisionPolicy`` gathers them in the run's bf16 / fp16 and reduces gradients in fp32.
Each sharded parameter (a DTensor) has a *local view*: an ``nn.Parameter`` sharing the storage of
the DTensor's local shard, carrying the original parameter's attributes (``tensor_model_parallel``,
``sequence_parallel``, ...). ``parameters()`` / ``named_parameters()`` of the wrapper yield these
views, so ``get_megatron_optimizer`` builds a MegatronOptimizer over the local fp32 shards, and the
grad statistics (reduced over the whole world) count each element once.

Gradients. Outside ``no_sync`` FSDP2 reduce-scatters (averages over dp) each layer's gradients
during backward; inside it, gradients accumulate unsharded. ``finish_grad_sync`` sets ``main_grad``
of every view (and of its DTensor) to the local shard of the reduced gradient (zeros where none), so
``finalize_model_grads`` sums sequence-parallel and tied-embedding gradients on the local shards:
the shards of a tp-replicated parameter cover the same rows on every tp rank of a dp rank, as do
the first and last stage's copies of a tied embedding.

Expert parameters (``moe.expert_params``). A module holding expert parameters (the experts of an
MoE layer) is a unit of its own, sharded over the expert-data-parallel group (the ranks holding the
same expert shard); FSDP2 averages their gradients over it and ``finish_grad_sync`` rescales them
by expert-dp / (dp x cp), so that they are divided by dp x cp as DDP scales them: each expert's
gradient already sums the tokens its expert-parallel peers routed to it. (FSDP2's own
``set_gradient_divide_factor`` reduces with PREMUL_SUM, which gloo lacks.)

Checkpoints. ``sharded_state_dict`` yields, for each parameter, the blocks of its local dim-0 shard
(rows [a, b) of the local tp shard are its flat range [a * cols, b * cols)) under the keys and
global shapes the unwrapped model gives, with data viewing the local shard: FSDP2 runs save and load
the same checkpoints as any other layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing.flat_ranges import flat_range_blocks
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.meta_init import dim0_shard_range, param_attrs, restore_param_attrs_
from megatron.core.parallel_state import ParallelState, get_parallel_state
from megatron.core.transformer.moe.expert_params import is_expert_param
from megatron.core.transformer.transformer_layer import TransformerLayer

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

ShardInit = Callable[[nn.Module], None]


def compute_dtype(config: Any) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in: bf16 / fp16 with ``config.bf16`` / ``fp16``, else None
    (the sharded fp32)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return None


class TorchFullyShardedDataParallel(nn.Module):
    """FSDP2 over one model chunk; Megatron-Core's constructor signature (plus ours, keyword-only).

    Args:
        config: the model's TransformerConfig (precision: ``bf16`` / ``fp16``).
        ddp_config: ``fsdp_sharding()`` picks ZeRO-3 (reshard after forward) or ZeRO-2.
        module: the chunk; its parameters become sharded DTensors.
        sub_modules_to_wrap: module types sharded as units of their own (default TransformerLayer).
        process_group: the group to shard over (default: the parallel state's dp x cp group).
        parallel_state: the groups (default: the one ``initialize_model_parallel`` recorded).
        init_shards: called with the sharded chunk before anything reads its parameters (the
            meta-device path materialises each rank's local shards there).

    Raises:
        ConfigError: no data-parallel process group (torch.distributed is not initialised).
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        sub_modules_to_wrap: Collection[type[nn.Module]] | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        parallel_state: ParallelState | None = None,
        init_shards: ShardInit | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.pg = parallel_state if parallel_state is not None else get_parallel_state()
        group = process_group if process_group is not None else self.pg.dp_cp_group
        if group is None:
            raise ConfigError(
                "use_torch_fsdp2 needs torch.distributed initialised and a data-parallel process group",
                params=("use_torch_fsdp2",),
            )
        self.dp_group = group
        self.dp_size = dist.get_world_size(group)
        attrs = param_attrs(module)  # fully_shard's DTensor parameters do not carry them
        tied = self._tied_name(module)
        if compute_dtype(config) is not None:
            module.float()  # sharded params are the optimizer's fp32 main params
        self.module = module
        self._shard(module, tuple(sub_modules_to_wrap or (TransformerLayer,)))
        restore_param_attrs_(module, attrs)
        if init_shards is not None:
            init_shards(module)
            restore_param_attrs_(module, attrs)
        self._views: dict[str, nn.Parameter] = {}
        self._dtensors: dict[str, DTensor] = {}
        with torch.no_grad():
            for name, p in module.named_parameters():
                assert isinstance(p, DTensor), f"fully_shard left {name} unsharded"
                view = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
                for key, value in attrs.get(name, {}).items():
                    setattr(view, key, value)
                self._views[name] = view
                self._dtensors[name] = p
        self._tied = (self._views[tied],) if tied is not None else ()
        # Expert gradients come back averaged over expert-dp; DDP's net scale is 1 / (dp x cp).
        self._expert_rescale = self.pg.expt_dp_size / self.dp_size
        self._experts = {name for name, view in self._views.items() if is_expert_param(view)}
        self._zeros: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------------------------- set-up
    @staticmethod
    def _tied_name(module: nn.Module) -> str | None:
        """The name of the parameter this chunk ties to another stage's copy (or None)."""
        weight_of = getattr(module, "shared_embedding_or_output_weight", None)
        if not getattr(module, "share_embeddings_and_output_weights", False) or not callable(weight_of):
            return None
        weight = weight_of()
        return next((n for n, p in module.named_parameters() if p is weight), None)

    def _shard(self, module: nn.Module, unit_types: tuple[type[nn.Module], ...]) -> None:
        """``fully_shard`` on every unit and on the root; forward / backward prefetch of the next unit."""
        device_type = "cuda" if dist.get_backend(self.dp_group) == "nccl" else "cpu"
        mesh = DeviceMesh.from_group(self.dp_group, device_type, mesh_dim_names=("dp",))
        dtype = compute_dtype(self.config)
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            if dtype is not None
            else MixedPrecisionPolicy(reduce_dtype=torch.float32)
        )
        reshard = self.ddp_config.fsdp_sharding() != "optim_grads"
        expert_units = self._expert_units(module)
        if expert_units:
            expt_group = self.pg.groups.get("expt_dp")
            assert expt_group is not None, "expert parameters need the expert-data-parallel group"
            expt_mesh = DeviceMesh.from_group(expt_group, device_type, mesh_dim_names=("expt_dp",))
        for unit in expert_units:
            fully_shard(unit, mesh=expt_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        units = [m for m in module.modules() if isinstance(m, unit_types) and m is not module]
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        fsdp_units = [u for u in units if isinstance(u, FSDPModule)]
        for prev, nxt in zip(fsdp_units, fsdp_units[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])

    @staticmethod
    def _expert_units(module: nn.Module) -> list[nn.Module]:
        """The outermost modules whose parameters are all expert parameters (e.g. an MoE layer's
        experts, whose forward reads its children's weights directly: the unit must be the module
        whose forward runs, so that FSDP2 gathers the weights before it).

        Raises:
            ConfigError: a module holds expert and dense parameters of its own (one FSDP2 unit
                shards over one group).
        """
        units: list[nn.Module] = []
        inside: set[str] = set()  # names of the chosen units
        for name, sub in module.named_modules():
            own = [is_expert_param(p) for p in sub.parameters(recurse=False)]
            if any(own) and not all(own):
                raise ConfigError(
                    f"use_torch_fsdp2: module {name or type(sub).__name__} holds expert and dense "
                    "parameters of its own; FSDP2 shards expert parameters as units of their own "
                    "(keep them in a submodule, as the MoE layer's experts)",
                    params=("use_torch_fsdp2",),
                )
            if any(name == u or name.startswith(u + ".") for u in inside) or sub is module:
                continue
            params = list(sub.parameters())
            if params and all(is_expert_param(p) for p in params):
                units.append(sub)
                inside.add(name)
        return units

    @property
    def fsdp_module(self) -> FSDPModule:
        assert isinstance(self.module, FSDPModule)
        return self.module

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The local view of the weight this chunk ties to another stage's copy, or None."""
        return self._tied[0] if self._tied else None

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The local fp32 shard views (what the optimizer updates), named as DDP names them."""
        base = prefix + ("." if prefix else "") + "module."
        for name, view in self._views.items():
            yield base + name, view

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, view in self.named_parameters():
            yield view

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ---------------------------------------------------------------------------------- gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients unsharded, without reduce-scatter (all micro-batches but the last)."""
        self.fsdp_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.fsdp_module.set_requires_gradient_sync(True)

    def zero_grad_buffer(self) -> None:
        """Start a step: drop the sharded gradients (FSDP2 would accumulate into them)."""
        for name, p in self._dtensors.items():
            p.grad = None
            p.main_grad = None  # type: ignore[attr-defined]
            view = self._views[name]
            view.grad = None
            view.main_grad = None  # type: ignore[attr-defined]

    def finish_grad_sync(self) -> None:
        """Every view's (and DTensor's) ``main_grad`` is its local shard of the dp-averaged gradient;
        zeros for parameters that got no gradient this step."""
        with torch.no_grad():
            for name, p in self._dtensors.items():
                view = self._views[name]
                grad = p.grad
                if grad is None:
                    local = self._zeros.get(name)
                    if local is None:
                        local = self._zeros[name] = torch.zeros_like(view)
                    else:
                        local.zero_()
                else:
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if name in self._experts and self._expert_rescale != 1.0:
                        local.mul_(self._expert_rescale)
                assert p.to_local().data_ptr() == view.data_ptr(), f"{name}'s local shard moved"
                p.main_grad = local  # type: ignore[attr-defined]
                view.main_grad = local  # type: ignore[attr-defined]

    def owned_main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param.main_grad`` after ``finish_grad_sync``: its local shard, all of which this rank owns."""
        grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
        return grad

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        for view in self._views.values():
            grad = getattr(view, "main_grad", None)
            if grad is not None:
                grad.mul_(factor)

    # ---------------------------------------------------------------------------------- checkpoints
    def _rows(self, name: str) -> tuple[int, int, int]:
        """(first row, end row, elements per row) of this rank's dim-0 shard of parameter ``name``."""
        p = self._dtensors[name]
        assert p.dim() > 0, f"FSDP2 shards dim 0; {name} is a scalar"
        rows = p.shape[0]
        cols = p.numel() // rows if rows else 0
        start, stop = dim0_shard_range(p)  # over its own mesh: dp x cp, or expert-dp
        assert stop - start == self._views[name].shape[0], (name, start, stop)
        return start, stop, cols

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        """The unwrapped model's sharded state dict, each parameter as the blocks of its local shard."""
        stand_ins = {name: _stand_in(p, self._views[name]) for name, p in self._dtensors.items()}

        def substitute(_module: nn.Module, state: dict, sd_prefix: str, _meta: Any) -> None:
            for name in list(state):
                local = name[len(sd_prefix) :]
                if local in stand_ins:
                    state[name] = stand_ins[local]

        handle = self.module.register_state_dict_post_hook(substitute)
        try:
            out = self.module.sharded_state_dict(prefix, *args, **kwargs)  # type: ignore[operator]
        finally:
            handle.remove()
        for name in self._dtensors:
            key = prefix + name
            st = out.get(key)
            if isinstance(st, ShardedTensor):
                out[key] = self._blocks(name, st)
        return out

    def _blocks(self, name: str, st: ShardedTensor) -> list[ShardedTensor]:
        start, stop, cols = self._rows(name)
        rid = st.replica_id
        rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0  # each dp rank writes its own rows
        flat = self._views[name].detach().view(-1)
        return flat_range_blocks(st, flat, start * cols, stop * cols, replica_id=rid)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)


def _stand_in(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``p``'s (tensor-parallel local) shape with the view's attributes: what the
    unwrapped model's sharded_state_dict reads to name and place the parameter."""
    meta = torch.empty(p.shape, dtype=view.dtype, device="meta")
    for key, value in vars(view).items():
        if key != "main_grad":
            setattr(meta, key, value)
    return meta
