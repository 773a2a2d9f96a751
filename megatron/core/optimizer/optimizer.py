"""MegatronOptimizer: mixed precision (fp32 main params), loss scaling and clipping around a torch optimizer.

Every bf16/fp16 model param gets an fp32 *main* copy that the inner optimizer updates; fp32 model
params are updated in place (their main param *is* the model param). Gradients come from
``param.main_grad`` (the fp32 buffer a DDP wrapper accumulates into) when it is set, else from
``param.grad``.

One step, with at most one host sync (none with ``step(sync=False)`` and no loss scaler):
  1. point each main param's ``.grad`` at its model grad (fp32: alias, no copy);
  2. fp16: unscale in place and raise a found-inf flag;
  3. Σ‖g‖² (and the zero count) over non-duplicate grads;
  4. one SUM all-reduce of ``[found_inf, Σ‖g‖², zeros]`` over the grad-stats group;
  5. fp16: read the found-inf flag (host sync), update the loss scaler, on overflow return;
  6. clip and update. AdamW (default kernels): one pass per tensor that divides the gradient by the
     clipping factor as it reads it, updates the fp32 param and moments and writes the model copy
     (:mod:`.fused_adamw`). Otherwise (SGD, ``--no-use-fused-adam``) the torch optimizer steps
     (fused kernels take clipping as their ``grad_scale``) and one multi-tensor copy refreshes the
     model params.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.config_utils import ConfigError
from megatron.core.dist_checkpointing import CheckpointError
from megatron.core.optimizer import cpu_offload, sharded_state
from megatron.core.optimizer.clip_grads import (
    count_zeros,
    counts_in_stats,
    grad_norm_sq,
    step_with_divisor,
    unscale_and_check_inf,
)
from megatron.core.optimizer.fused_adamw import adamw_step
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import KERNEL_KEYS, OptimizerConfig


def make_inner_optimizer(
    config: OptimizerConfig, groups: list[dict[str, Any]], host: frozenset[int] = frozenset()
) -> torch.optim.Optimizer:
    """torch AdamW (fused on CUDA, foreach elsewhere) or SGD with momentum over ``groups``; the
    kernels follow the params other than ``host`` (ids of offloaded main params it never steps)."""
    params = [p for g in groups for p in g["params"] if id(p) not in host]
    if not config.use_fused_adam:
        kernel: dict[str, bool] = {"foreach": False}
    elif all(p.is_cuda for p in params):
        kernel = {"fused": True}
    else:
        kernel = {"foreach": True}
    lr = config.lr if config.lr is not None else 0.0
    if config.optimizer == "adam":
        betas = (config.adam_beta1, config.adam_beta2)
        return torch.optim.AdamW(
            groups, lr=lr, betas=betas, eps=config.adam_eps, weight_decay=config.weight_decay, **kernel
        )
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay, **kernel
        )
    raise ConfigError(
        f"optimizer {config.optimizer!r} is not valid; choose one of ['adam', 'sgd']", params=("optimizer",)
    )


class MegatronOptimizer:
    """Wraps a torch optimizer with fp32 main params, loss scaling and global-norm clipping.

    Args:
        config: optimizer settings (``clip_grad``, ``log_num_zeros_in_grad``, kernel choice).
        param_groups: dicts with ``params`` (model params), ``name``, ``wd_mult`` and ``lr_mult``.
        grad_scaler: loss scaler for fp16 (or an explicit ``--loss-scale``); None for no scaling.
        grad_stats_group: process group over which the found-inf flag, Σ‖g‖² and the zero count are
            summed: the model-parallel group for this (non-distributed) optimizer. None means no
            reduction, i.e. this rank's grads cover the whole model (single process or pure DP).
        tp_rank: this rank's tensor-parallel rank, for :func:`param_is_not_duplicate`.
        param_sync: called after every successful step (the distributed optimizer's broadcast of
            the updated params from their owners); ``param_groups`` then hold only owned params. If
            it has ``wait_all`` (an overlapped broadcast), :meth:`finish_param_sync` calls it.
        replica_ranks: (dp x cp rank, expert-dp rank) when ``grad_stats_group`` spans data-parallel
            replicas (a model with expert parameters: the world), so that each gradient counts once
            (:func:`counts_in_stats`); ``(0, 0)`` otherwise.

    ``param_groups`` (the inner optimizer's groups, holding main params) carry ``lr`` and
    ``weight_decay``, which :class:`OptimizerParamScheduler` sets.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        param_groups: list[dict[str, Any]],
        grad_scaler: MegatronGradScaler | None = None,
        grad_stats_group: dist.ProcessGroup | None = None,
        tp_rank: int = 0,
        param_sync: Callable[[], None] | None = None,
        *,
        replica_ranks: tuple[int, int] = (0, 0),
    ) -> None:
        self.config = config
        # Reject a step whose gradient norm is NaN/Inf on the device, as ``step(reject=...)`` does
        # (the trainer sets it from --check-for-nan-in-loss-and-grad).
        self.skip_non_finite = False
        self.param_sync = param_sync
        self.grad_scaler = grad_scaler
        self.grad_stats_group = grad_stats_group
        self.model_params: list[torch.nn.Parameter] = []
        self.main_params: list[torch.Tensor] = []
        inner_groups = []
        # CPU offload: these params' fp32 main copies live in host memory (.cpu_offload).
        every = [p for group in param_groups for p in group["params"]]
        fraction = config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0
        to_host = {id(p) for p, h in zip(every, cpu_offload.select_offloaded(every, fraction)) if h}
        for group in param_groups:
            mains = []
            for p in group["params"]:
                if id(p) in to_host:
                    main = cpu_offload.host_main_param(p, config)
                else:
                    main = p if p.dtype == torch.float32 else p.detach().clone().float()
                self.model_params.append(p)
                self.main_params.append(main)
                mains.append(main)
            inner = {k: v for k, v in group.items() if k != "params"}
            inner["params"] = mains
            inner_groups.append(inner)
        self._counts_in_stats = [counts_in_stats(p, tp_rank, replica_ranks) for p in self.model_params]
        offloaded = [(p, m) for p, m in zip(self.model_params, self.main_params) if id(p) in to_host]
        self._copy_pairs = [
            (p, m) for p, m in zip(self.model_params, self.main_params) if p is not m and id(p) not in to_host
        ]
        self.device = self.model_params[0].device if self.model_params else torch.device("cpu")
        host = frozenset(id(m) for _, m in offloaded)
        self.optimizer = make_inner_optimizer(config, inner_groups, host)
        self._offload = cpu_offload.CpuOffload(config, self.optimizer, offloaded) if offloaded else None
        # AdamW with the multi-tensor/fused kernel choice runs our one-pass step (fused_adamw.py).
        self._one_pass_adamw = config.optimizer == "adam" and config.use_fused_adam
        self._model_of_main = {id(m): p for p, m in self._copy_pairs}
        self._sharded_keys: sharded_state.Plan | None = None

    def offload_summary(self) -> str | None:
        """One start-up line on what this rank's CPU offload holds and how it steps; None without it."""
        return self._offload.describe() if self._offload is not None else None

    # ---------------------------------------------------------------- loss scaling
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (main params, ``lr``, ``weight_decay``, ``lr_mult``, ``wd_mult``)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler), as a Python float."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``; call backward on the result."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    # ---------------------------------------------------------------- step
    def _prepare_main_grads(self, keep_model_dtype: bool) -> list[torch.Tensor | None]:
        """Each main param's gradient, or None. An fp32 gradient becomes the main param's ``.grad``
        (an alias); a bf16/fp16 one is widened into a fresh fp32 ``.grad``, unless ``keep_model_dtype``
        (the one-pass AdamW widens as it reads): then it is returned as is and ``.grad`` stays None."""
        grads: list[torch.Tensor | None] = []
        for model_p, main_p, g in zip(self.model_params, self.main_params, self._model_grads()):
            if g is None or (keep_model_dtype and g.dtype != main_p.dtype):
                if main_p is not model_p:
                    main_p.grad = None
                grads.append(g)
                continue
            if g.dtype != main_p.dtype:
                g = g.to(main_p.dtype)
            if self._offload is None or not self._offload.holds(main_p):
                main_p.grad = g  # an offloaded (host) main's gradient reaches it in CpuOffload.step
            grads.append(g)
        return grads

    def _model_grads(self) -> list[torch.Tensor | None]:
        """Each model param's gradient: its ``main_grad`` (a DDP buffer) when set, else ``.grad``."""
        grads = []
        for p in self.model_params:
            g = getattr(p, "main_grad", None)
            grads.append(g if g is not None else p.grad)
        return grads

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        group = self.grad_stats_group
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

    @torch.no_grad()
    def step(self, sync: bool = True, reject: torch.Tensor | None = None) -> tuple[Any, Any, Any]:
        """Unscale, check overflow, clip and update.

        Args:
            sync: return Python numbers (one host sync). ``False`` returns the grad norm (and zero
                count) as 0-dim device tensors and, without a loss scaler, never waits for the
                device, so the caller can queue the next step before reading them. With a loss
                scaler (fp16) the step always syncs: whether to skip depends on the overflow flag.
            reject: a 0-dim device flag (> 0: do not update), summed over the grad-stats group with
                the norms, so that a flag raised on one rank (a non-finite loss on the last pipeline
                stage) rejects the step everywhere. With it, or with ``skip_non_finite``, the
                decision stays on the device: the one-pass AdamW and torch's fused kernels skip by a
                device flag; other inner optimizers read it (one host sync). With ``sync=False``
                ``update_successful`` is then a 0-dim bool device tensor.

        Returns:
            ``(update_successful, grad_norm, num_zeros)``. On overflow (fp16) nothing is updated and
            the result is ``(False, None, None)``; a grad norm above ``config.grad_norm_skip_threshold``
            updates nothing and returns ``(False, grad_norm, num_zeros)``. ``grad_norm`` is the global
            pre-clip L2 norm over non-duplicate grads; ``num_zeros`` is None unless ``config.log_num_zeros_in_grad``.
        """
        self.finish_param_sync()  # no broadcast of the last step may still read or write a param
        # Low-precision gradients (DDP's aliased single gradients) stay as they are for the
        # one-pass AdamW and the norms, which compute in fp32: no widened copy.
        keep = self._one_pass_adamw and self.grad_scaler is None
        grads = self._prepare_main_grads(keep_model_dtype=keep)
        present = [g for g in grads if g is not None]
        counted = [g for g, c in zip(grads, self._counts_in_stats) if g is not None and c]
        if self.grad_scaler is not None:
            found_inf = unscale_and_check_inf(present, self.grad_scaler.inv_scale, self.device)
        else:
            found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        parts = [found_inf, grad_norm_sq(counted, self.device)]
        if self.config.log_num_zeros_in_grad:
            parts.append(count_zeros(counted, self.device))
        guarded = reject is not None or self.skip_non_finite
        if guarded:  # the last slot: the callers' reject flags, summed with the norms
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            parts.append(zero if reject is None else reject.to(device=self.device, dtype=torch.float32))
        stats = torch.stack(parts)
        self._reduce_stats(stats)
        if self.grad_scaler is not None:
            found = stats[0].item() > 0.0  # the step's one host sync
            self.grad_scaler.update(found)
            if found:
                return False, None, None
        grad_norm = stats[1].sqrt()
        if math.isfinite(self.config.grad_norm_skip_threshold) and present:
            if math.sqrt(stats[1].item()) > self.config.grad_norm_skip_threshold:
                return self._skipped(stats, sync)
        divisor = self._clip_divisor(grad_norm) if present else None
        skip = None
        if guarded:
            skip = stats[-1] > 0
            if self.skip_non_finite:
                skip = skip | ~torch.isfinite(stats[1])
            if not self._skips_on_device():
                if bool(skip.item()):  # the step's one host sync
                    return self._rejected(stats, sync, skip)
                skip = None
        if self._offload is not None:  # offloaded params: gradients to the host, stepped there below
            on_host = [self._offload.holds(m) for m in self.main_params]
            self._offload.start_grad_copies([g for g, h in zip(grads, on_host) if h], divisor)
            grads = [None if h else g for g, h in zip(grads, on_host)]
        if self._one_pass_adamw:
            adamw_step(
                self.optimizer,
                self._model_of_main,
                divisor,
                grads={id(m): g for m, g in zip(self.main_params, grads) if g is not None},
                compile=self.config.compile_helpers,
                skip=skip,
            )
        else:
            step_with_divisor(self.optimizer, [g for g in grads if g is not None], divisor, found_inf=skip)
            self._copy_main_params_to_model_params()
        if self._offload is not None:
            self._offload.step()
        if self.param_sync is not None:
            self.param_sync()
        num_zeros = stats[2] if self.config.log_num_zeros_in_grad else None
        if not sync:
            return (True if skip is None else ~skip), grad_norm, num_zeros
        values = stats.tolist()
        applied = True if skip is None else not bool(skip.item())
        return applied, math.sqrt(values[1]), int(values[2]) if num_zeros is not None else None

    def _skips_on_device(self) -> bool:
        """Whether a rejected step can be skipped by a device flag: the one-pass AdamW, or torch's
        fused kernels (their ``found_inf``), with nothing stepped on the host."""
        if self._offload is not None:
            return False
        return self._one_pass_adamw or all(g.get("fused") for g in self.optimizer.param_groups)

    def _rejected(self, stats: torch.Tensor, sync: bool, skip: torch.Tensor) -> tuple[Any, Any, Any]:
        """``step``'s result when the step was rejected and decided on the host: no update."""
        _, norm, zeros = self._skipped(stats, sync)
        return (~skip if not sync else False), norm, zeros

    def _skipped(self, stats: torch.Tensor, sync: bool) -> tuple[bool, Any, Any]:
        """``step``'s result when the grad norm is above ``config.grad_norm_skip_threshold``: no update."""
        zeros = self.config.log_num_zeros_in_grad
        if not sync:
            return False, stats[1].sqrt(), stats[2] if zeros else None
        values = stats.tolist()
        return False, math.sqrt(values[1]), int(values[2]) if zeros else None

    def finish_param_sync(self) -> None:
        """Wait for the last step's weight broadcasts still in flight (``--overlap-param-gather``):
        call before reading the model's parameters outside a forward pass (saving a checkpoint)."""
        wait_all = getattr(self.param_sync, "wait_all", None)
        if wait_all is not None:
            wait_all()

    def _clip_divisor(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """``max(1, (‖g‖ + 1e-6) / clip_grad)`` as a 0-dim fp32 device tensor; None when clipping is off."""
        clip = self.config.clip_grad
        if clip <= 0.0:
            return None
        return torch.clamp((grad_norm + 1.0e-6) / clip, min=1.0).to(torch.float32)

    def _copy_main_params_to_model_params(self) -> None:
        if self._copy_pairs:
            torch._foreach_copy_([p for p, _ in self._copy_pairs], [m for _, m in self._copy_pairs])

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Re-copy the model params into the fp32 main params (after loading model weights only)."""
        if self._copy_pairs:
            torch._foreach_copy_([m for _, m in self._copy_pairs], [p for p, _ in self._copy_pairs])
        if self._offload is not None:
            self._offload.reload_from_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop ``.grad`` of model and main params and zero the ``main_grad`` buffers in place."""
        buffers = []
        for model_p, main_p in zip(self.model_params, self.main_params):
            model_p.grad = None
            main_p.grad = None
            g = getattr(model_p, "main_grad", None)
            if g is not None:
                buffers.append(g)
        if buffers:
            torch._foreach_zero_(buffers)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, loss-scaler state and the fp32 main copies of bf16/fp16 params.

        Tensors are references to live state (as in ``torch.optim``): serialise before stepping on.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "fp32_from_fp16_params": [m for _, m in self._fp32_from_fp16_pairs()],
        }

    def _fp32_from_fp16_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, fp32 main) of every bf16/fp16 param, on the device or offloaded."""
        return [(p, m) for p, m in zip(self.model_params, self.main_params) if p.dtype != m.dtype]

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the param layout must be the one that saved it.

        Raises:
            CheckpointError: the saved main params do not match this optimizer's params.
        """
        kernels = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for group, flags in zip(self.optimizer.param_groups, kernels):
            group.update(flags)
        self._place_step_tensors()
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict.get("fp32_from_fp16_params") or []
        pairs = self._fp32_from_fp16_pairs()
        if not saved and (pairs or self._offload is not None):
            self.reload_model_params()  # checkpoint from an fp32 run (or the model's own fp32 weights)
            return
        if len(saved) != len(pairs):
            raise CheckpointError(
                f"checkpoint has {len(saved)} fp32 main params, this model has {len(pairs)} "
                "bf16/fp16 params: was it saved with a different model or precision (bf16 / fp16)?"
            )
        for (_, main), value in zip(pairs, saved):
            if main.shape != value.shape:
                raise CheckpointError(
                    f"fp32 main param shape {tuple(value.shape)} != model's {tuple(main.shape)}"
                )
            main.copy_(value)

    def _place_step_tensors(self) -> None:
        """Fused/capturable kernels want ``step`` on the param's device, others on the host."""
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                step = self.optimizer.state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    dev = p.device if on_device else torch.device("cpu")
                    self.optimizer.state[p]["step"] = step.to(device=dev, dtype=torch.float32)

    def init_state(self) -> None:
        """Create optimizer state (zeros, step 0) for params that have none yet.

        The values equal what the torch optimizer would create at its first step, so training is
        unchanged; it lets a fresh optimizer describe (and receive) its state for a checkpoint.
        """
        sharded_state.init_state(self.optimizer, self.config)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict, common_replica_id: int | None = None
    ) -> dict[str, Any]:
        """Distributed-checkpoint view of the optimizer state; see :mod:`.sharded_state`.

        Per-param state takes the sharding (key, global shape/offset, replica id) of the model param
        it belongs to. ``common_replica_id`` is the replica id of the ``optimizer.common`` object,
        whose content is the same on every rank; by default 0 (the writer) on global rank 0 only.
        """
        if common_replica_id is None:
            initialized = dist.is_available() and dist.is_initialized()
            common_replica_id = 0 if not initialized or dist.get_rank() == 0 else 1
        result, keys = sharded_state.build(self, model_sharded_state_dict, common_replica_id)
        self._sharded_keys = keys
        return result

    def load_sharded_state_dict(
        self, loaded: dict[str, Any], model_sharded_state_dict: dict | None = None
    ) -> None:
        """Apply what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`'s output.

        Call after the model weights are loaded. ``model_sharded_state_dict`` is needed only when
        :meth:`sharded_state_dict` was not called on this optimizer.
        """
        if model_sharded_state_dict is not None or self._sharded_keys is None:
            if model_sharded_state_dict is None:
                raise ValueError("call sharded_state_dict(...) first or pass model_sharded_state_dict")
            self._sharded_keys = sharded_state.param_keys(self, model_sharded_state_dict)
        sharded_state.apply(self, loaded, self._sharded_keys)
