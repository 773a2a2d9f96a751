"""The top-k router: logits ``x @ W_r^T``, each token's experts and weights, the auxiliary losses.

Layout invariance: the same tokens route identically and receive the same auxiliary-loss gradients
whether they sit on one rank or are split over tp (sequence parallel) and cp ranks. Token statistics
are summed over ``groups.tp_cp`` (``groups.tp_dp_cp`` for ``global_aux_loss``) and each rank adds
its share of the group's loss (``moe_utils``' module docstring). Capacity is per rank, as in
Megatron-Core: ``ceil(c * T * k / E)`` with ``T`` this rank's tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.fusions.compile import MaybeCompiled
from megatron.core.tensor_parallel.init import set_init_attrs, tag_param
from megatron.core.tensor_parallel.mappings import group_size, reduce_from_tp
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.groups import MoEGroups


def _routing_and_aux_scores(
    logits: torch.Tensor,
    topk: int,
    pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float | None,
    score_function: str,
    expert_bias: torch.Tensor | None,
    with_aux: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(probs, routing_map, aux_map, aux_scores)``: the routing and, ``with_aux``, the statistics
    the load-balancing losses read (both pure functions of the logits, computed in one call)."""
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, topk, pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias
    )
    if not with_aux:
        return probs, routing_map, None, None
    aux_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function)
    return probs, routing_map, aux_map, scores


# The routing math compiled on CUDA where the plan compiles helpers (one graph of small kernels).
_route = MaybeCompiled(_routing_and_aux_scores)
_switch_loss = MaybeCompiled(moe_utils.switch_load_balancing_loss_func)


@functools.cache
def _mm_to_fp32_runs(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 inputs here (CUDA)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_LOSS_NAMES = dict(zip(_BALANCING[:3], moe_utils.AUX_LOSS_NAMES))


class _RouterGating(torch.autograd.Function):
    """``x @ weight^T`` computed in ``dtype``, saving ``x`` and ``weight`` in their own dtypes (no
    fp32 copy of the activations is kept); gradients come back in the inputs' dtypes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        if (
            dtype == torch.float32
            and x.is_cuda
            and x.dtype == weight.dtype == torch.bfloat16
            and _mm_to_fp32_runs(x.device.type)
        ):
            # bf16 products are exact in fp32 and the GEMM sums in fp32: the fp32 GEMM's values,
            # without an fp32 copy of the tokens.
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return torch.mm(x.to(dtype), weight.to(dtype).t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        dx = torch.mm(grad, weight.to(ctx.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = torch.mm(grad.t(), x.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _balancing_coeffs(config: Any) -> dict[str, float]:
    """``{load-balancing type: coeff}`` of the types in use with a coefficient > 0 (a list of types
    pairs with a list of coefficients, as in Megatron-Core)."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    if len(coeffs) != len(types):
        raise ConfigError(
            f"moe_aux_loss_coeff {config.moe_aux_loss_coeff} needs one coefficient per "
            f"moe_router_load_balancing_type {config.moe_router_load_balancing_type}",
            params=("moe_aux_loss_coeff", "moe_router_load_balancing_type"),
        )
    for t in types:
        if t not in _BALANCING:
            raise ConfigError(
                f"moe_router_load_balancing_type {t!r} is not supported; choose one of {list(_BALANCING)}",
                params=("moe_router_load_balancing_type",),
            )
    return {t: float(c) for t, c in zip(types, coeffs) if t != "none" and c > 0}


def aux_loss_names(config: Any) -> list[str]:
    """The tracker names the routers of ``config`` record (``track_moe_metrics``' ``track_names``:
    every pipeline stage must reduce the same ones)."""
    names = [_LOSS_NAMES[t] for t in _balancing_coeffs(config)]
    return names + (["z_loss"] if config.moe_z_loss_coeff else [])


def check_router_config(config: Any) -> None:
    """Raise ``ConfigError`` naming the field for a router setting this router cannot run."""
    num_experts, topk = config.num_moe_experts, config.moe_router_topk
    if not num_experts or num_experts < 1:
        raise ConfigError("num_moe_experts must be a positive number of experts", params=("num_moe_experts",))
    if not 1 <= topk <= num_experts:
        raise ConfigError(
            f"moe_router_topk {topk} must be in [1, num_moe_experts={num_experts}]",
            params=("moe_router_topk", "num_moe_experts"),
        )
    if config.moe_router_score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ConfigError(
            f"moe_router_score_function {config.moe_router_score_function!r} is not valid; choose "
            "softmax, sigmoid or sqrtsoftplus",
            params=("moe_router_score_function",),
        )
    if config.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ConfigError(
            f"moe_router_dtype {config.moe_router_dtype!r} is not valid; choose fp32 or fp64",
            params=("moe_router_dtype",),
        )
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if bool(groups) != bool(group_topk):
        raise ConfigError(
            "moe_router_num_groups and moe_router_group_topk go together; set both or neither",
            params=("moe_router_num_groups", "moe_router_group_topk"),
        )
    if groups and (num_experts % groups or group_topk > groups or topk % group_topk):
        raise ConfigError(
            f"group-limited routing needs num_moe_experts ({num_experts}) divisible by "
            f"moe_router_num_groups ({groups}), moe_router_group_topk ({group_topk}) <= the groups "
            f"and dividing moe_router_topk ({topk}), e.g. moe_router_group_topk=1",
            params=("num_moe_experts", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk"),
        )
    if groups and topk > group_topk * (num_experts // groups):
        raise ConfigError(
            f"moe_router_topk {topk} exceeds the experts of moe_router_group_topk={group_topk} groups",
            params=("moe_router_topk", "moe_router_group_topk"),
        )
    if config.moe_router_enable_expert_bias and config.moe_router_score_function == "softmax":
        raise ConfigError(
            "moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (Megatron-Core's "
            "rule: the bias is added to sigmoid scores)",
            params=("moe_router_enable_expert_bias", "moe_router_score_function"),
        )
    if config.moe_token_drop_policy not in ("probs", "position"):
        raise ConfigError(
            f"moe_token_drop_policy {config.moe_token_drop_policy!r} is not valid; choose probs or position",
            params=("moe_token_drop_policy",),
        )
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ConfigError(
            f"moe_expert_capacity_factor must be > 0 (or None: no dropping), got {factor}",
            params=("moe_expert_capacity_factor",),
        )
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ConfigError(
            "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (e.g. 1.0)",
            params=("moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"),
        )
    _balancing_coeffs(config)


class TopKRouter(nn.Module):
    """Routes each token to ``moe_router_topk`` of ``num_moe_experts`` experts.

    Parameters and buffers: ``weight`` ``[E, h]`` (replicated; with sequence parallelism its
    gradient is summed over tp); with ``moe_router_enable_expert_bias`` the fp32 buffers
    ``expert_bias`` ``[E]`` (persistent) and ``local_tokens_per_expert`` ``[E]`` (tokens routed
    since the last ``moe_utils.update_expert_bias``); with ``global_aux_loss`` the non-persistent
    ``global_tokens_per_expert`` / ``ga_steps`` (reset each step by
    ``moe_utils.reset_global_aux_loss_tracker``).

    Args:
        config: a ``TransformerConfig`` with the ``moe_*`` fields.
        groups: the MoE process groups (``None``: one rank).
        layer_number: 1-based index of the layer among all ``config.num_layers`` (the tracker row).
    """

    def __init__(self, config: Any, groups: MoEGroups | None = None, layer_number: int = 1) -> None:
        super().__init__()
        check_router_config(config)
        self.config = config
        self.groups = groups or MoEGroups()
        self.layer_number = layer_number
        self._unrecorded_passes = 0
        self.compile_helpers = False  # the routing math as compiled kernels (MoELayer sets the plan's choice)
        moe_utils.ROUTERS.add(self)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.router_dtype = torch.float64 if config.moe_router_dtype == "fp64" else torch.float32
        self.aux_coeffs = _balancing_coeffs(config)
        # Tokens are the same on every tp rank without sequence parallelism: each tp replica then
        # adds the whole tp slice's share (tp times the share its tp_cp counts give).
        sp = bool(getattr(config, "sequence_parallel", False))
        self.replica_scale = 1 if sp else group_size(self.groups.tp)

        self.weight = nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype)
        )
        # A deterministic start for standalone use; a model re-initialises it from ``init_std``.
        gen = torch.Generator().manual_seed(layer_number)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * config.init_method_std)
        set_init_attrs(self.weight, std=config.init_method_std)
        tag_param(self.weight, sequence_parallel=sp and group_size(self.groups.tp) > 1)

        self.expert_bias: torch.Tensor | None
        self.local_tokens_per_expert: torch.Tensor | None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32),
                persistent=False,
            )
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.global_tokens_per_expert: torch.Tensor | None
        self.ga_steps: torch.Tensor | None
        if "global_aux_loss" in self.aux_coeffs:
            self.register_buffer(
                "global_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32),
                persistent=False,
            )
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.float32), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None

    @torch.no_grad()
    def reset_buffers_(self) -> None:
        """Zero the bias and the counts (after ``to_empty`` materialises a meta-built model)."""
        for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, torch.zeros_like(buf, dtype=torch.float32))

    def keep_fp32_buffers(self) -> None:
        """Return the bias and counts to fp32 after a model-wide dtype cast (a bf16 bias would
        round away its small updates)."""
        for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert"):
            buf = getattr(self, name)
            if buf is not None and buf.dtype != torch.float32:
                setattr(self, name, buf.float())

    def _first_pass(self) -> bool:
        """Whether this training forward records losses and statistics: once per micro-batch. A
        recompute runs inside backward; it records only in place of a first pass that ran without
        a graph (reentrant checkpointing), counted in ``_unrecorded_passes``."""
        if not moe_utils.in_backward():
            return True
        if self._unrecorded_passes > 0:
            self._unrecorded_passes -= 1
            return True
        return False

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def _num_layers(self) -> int:
        return self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, h]`` -> logits ``[T, E]`` in the router dtype (fp32, or fp64)."""
        return _RouterGating.apply(x, self.weight, self.router_dtype)

    def forward(self, x: torch.Tensor, num_sequences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route the tokens of ``x``.

        Args:
            x: ``[s, b, h]``, or ``[T, h]`` = that flattened (token ``t = s_idx * b + b_idx``).
            num_sequences: ``b`` for a 2-D ``x`` (needed by ``seq_aux_loss``, which balances each
                sequence; ``s`` is then ``T / b``).

        Returns:
            ``(probs [T, E] float32, routing_map [T, E] bool)``: the weights of each token's kept
            experts (0 elsewhere, and on padding slots) and where tokens go (with
            ``moe_pad_expert_input_to_capacity`` exactly the capacity per expert).
        """
        self.keep_fp32_buffers()
        if x.dim() == 3:
            num_sequences = x.shape[1]
        x = x.reshape(-1, x.shape[-1])
        training = self.training and torch.is_grad_enabled()
        if self.training and not torch.is_grad_enabled() and not moe_utils.in_backward():
            self._unrecorded_passes += 1  # a reentrant checkpoint's first pass; its recompute records
        record = training and self._first_pass()
        if training and self.config.moe_input_jitter_eps:
            eps = self.config.moe_input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(x)  # [T, E]
        if training and self.config.moe_z_loss_coeff:
            logits = self._apply_z_loss(logits, record)
        with_aux = training and bool(self.aux_coeffs)
        probs, routing_map, aux_map, aux_scores = _route(
            logits,
            self.topk,
            self.config.moe_router_pre_softmax,
            self.config.moe_router_num_groups,
            self.config.moe_router_group_topk,
            self.config.moe_router_topk_scaling_factor,
            self.score_function,
            self.expert_bias,
            with_aux,
            compile=self.compile_helpers,
        )
        kept = routing_map
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = moe_utils.apply_router_token_dropping(
                probs,
                routing_map,
                self.topk,
                self.config.moe_expert_capacity_factor,
                self.config.moe_token_drop_policy,
                self.config.moe_pad_expert_input_to_capacity,
            )
            kept = kept & routing_map
        if training and self.aux_coeffs:
            assert aux_map is not None and aux_scores is not None
            probs = self._apply_load_balancing(probs, aux_map, aux_scores, num_sequences, record)
        if record:
            self._record_stats(kept, logits.shape[0])
        return probs.float(), routing_map

    # -- auxiliary losses ----------------------------------------------------------------------

    def _attach(
        self,
        activation: torch.Tensor,
        share: torch.Tensor,
        name: str,
        coeff: float,
        group: Any,
        record: bool,
    ) -> torch.Tensor:
        """Record ``share / coeff`` (the shares sum to the loss over ``group``) and inject the
        share of this rank's tokens into backward."""
        if record:
            moe_utils.save_to_aux_losses_tracker(
                name,
                share / coeff,
                self.layer_number,
                self._num_layers(),
                reduce_group=group,
                needs_dp_avg=name != "global_load_balancing_loss",  # its group already spans dp
            )
        injected = share * self.replica_scale
        if getattr(self.config, "calculate_per_token_loss", False):
            # The per-token-loss gradient divides by the step's token count: scale back by this
            # slice's tokens so the aux loss keeps its 1 / num_microbatches weight.
            injected = injected * (activation.shape[0] * group_size(self.groups.tp_cp))
        return moe_utils.MoEAuxLossAutoScaler.apply(activation, injected)

    def _apply_z_loss(self, logits: torch.Tensor, record: bool) -> torch.Tensor:
        """z-loss share ``coeff * sum_local(lse^2) / T_group``, ``T_group = T * |tp_cp|`` (tp and
        cp slices hold equal numbers of tokens)."""
        coeff = self.config.moe_z_loss_coeff
        share = moe_utils.z_loss_func(logits, coeff / group_size(self.groups.tp_cp))
        return self._attach(logits, share, "z_loss", coeff, self.groups.tp_cp, record)

    def _apply_load_balancing(
        self,
        probs: torch.Tensor,
        aux_map: torch.Tensor,
        scores: torch.Tensor,
        num_sequences: int | None,
        record: bool,
    ) -> torch.Tensor:
        for kind, coeff in self.aux_coeffs.items():
            if kind == "aux_loss":
                share = self._switch_share(scores, aux_map, coeff, self.groups.tp_cp)
                group = self.groups.tp_cp
            elif kind == "seq_aux_loss":
                if not num_sequences:
                    raise ValueError(
                        "seq_aux_loss needs the sequences: pass x as [s, b, h] or num_sequences=b"
                    )
                b = num_sequences
                # [s, b, E] -> [s, b * E]: each sequence's experts are separate columns.
                seq_scores = scores.reshape(-1, b * self.num_experts)
                seq_map = aux_map.reshape(-1, b * self.num_experts)
                share = self._switch_share(seq_scores, seq_map, coeff, self.groups.tp_cp) / b
                group = self.groups.tp_cp
            else:
                share = self._global_share(scores, aux_map, coeff, record)
                group = self.groups.tp_dp_cp
            probs = self._attach(probs, share, _LOSS_NAMES[kind], coeff, group, record)
        return probs

    def _switch_share(
        self, scores: torch.Tensor, aux_map: torch.Tensor, coeff: float, group: Any
    ) -> torch.Tensor:
        counts = reduce_from_tp(aux_map.sum(dim=0), group)
        total = scores.shape[0] * group_size(group)
        return _switch_loss(
            scores, counts, total, self.topk, self.num_experts, coeff, compile=self.compile_helpers
        )

    def _global_share(
        self, scores: torch.Tensor, aux_map: torch.Tensor, coeff: float, record: bool
    ) -> torch.Tensor:
        """Counts averaged over the step's micro-batches so far, over every rank of the stage (a
        recompute reuses the running mean as it stands)."""
        group = self.groups.tp_dp_cp
        counts = reduce_from_tp(aux_map.sum(dim=0), group)
        assert self.global_tokens_per_expert is not None and self.ga_steps is not None
        if record:
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
        mean_counts = self.global_tokens_per_expert / self.ga_steps.clamp_min(1)
        total = scores.shape[0] * group_size(group)
        return moe_utils.switch_load_balancing_loss_func(
            scores, mean_counts, total, self.topk, self.num_experts, coeff
        )

    def reset_global_aux_loss_tracker(self) -> None:
        if self.global_tokens_per_expert is not None and self.ga_steps is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    # -- statistics ----------------------------------------------------------------------------

    @torch.no_grad()
    def _record_stats(self, kept: torch.Tensor, num_tokens: int) -> None:
        """Tokens per expert and dropped token-expert pairs (device tensors, read at log time) and
        the expert-bias counts, once per training micro-batch."""
        # Without sequence parallelism the tp ranks hold copies of the same tokens: each counts
        # its share so that sums over tp x dp x cp count every token once.
        copies = float(self.replica_scale)
        counts = kept.sum(dim=0).float()  # [E]
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += counts / copies
        group, n = self.groups.tp_dp_cp, self._num_layers()
        routed = torch.full((), float(num_tokens * self.topk) / copies, device=counts.device)
        moe_utils.save_to_moe_stats_tracker("tokens_per_expert", counts / copies, self.layer_number, n, group)
        moe_utils.save_to_moe_stats_tracker("routed_tokens", routed, self.layer_number, n, group)
        moe_utils.save_to_moe_stats_tracker(
            "dropped_tokens", routed - counts.sum() / copies, self.layer_number, n, group
        )
