"""ModelParallelConfig: Megatron-Core's base config of the parallel layout, precision and hooks.

Every field of Megatron-Core 0.19.2's ``ModelParallelConfig`` exists here with its default.
``TransformerConfig`` derives from it and redefines the fields this package implements (with their
documentation and flags); the others are Megatron-Core's knobs, and ``MPC_NO_EFFECT`` /
``MPC_REFUSED`` say field by field what each does here: accepted without effect (a performance or
memory knob of a mechanism this package does not have) or refused when set away from its default
(a feature not built yet), with the reason. docs/library.md is written from these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.core.config_utils import ConfigError, doc


@dataclass
class ModelParallelConfig:
    """Megatron-Core's parallel-layout, precision and training-hook fields (see the module docstring)."""

    tensor_model_parallel_size: int = doc(1, flag=None)
    tensor_parallel_num_weight_shards: int | None = doc(None, flag=None)
    gtp_weight_remat_size: int = doc(1, flag=None)
    pipeline_model_parallel_comm_backend: Literal["nccl", "ucc"] | None = doc(None, flag=None)
    pipeline_model_parallel_size: int = doc(1, flag=None)
    virtual_pipeline_model_parallel_size: int | None = doc(None, flag=None)
    sequence_parallel: bool = doc(False, flag=None)
    context_parallel_size: int = doc(1, flag=None)
    hierarchical_context_parallel_sizes: list[int] | None = doc(None, flag=None)
    max_seqlen_per_dp_cp_rank: int | None = doc(None, flag=None)
    hybrid_context_parallel: bool = doc(False, flag=None)
    expert_model_parallel_size: int = doc(1, flag=None)
    expert_tensor_parallel_size: int | None = doc(None, flag=None)
    expert_tensor_parallel_num_weight_shards: int | None = doc(None, flag=None)
    expert_gtp_weight_remat_size: int = doc(1, flag=None)
    perform_initialization: bool = doc(True, flag=None)
    use_cpu_initialization: bool = doc(False, flag=None)
    fp16: bool = doc(False, flag=None)
    bf16: bool = doc(False, flag=None)
    params_dtype: torch.dtype = doc(torch.float32, flag=None)
    timers: Callable | None = doc(None, flag=None)
    finalize_model_grads_func: Callable | None = doc(None, flag=None)
    grad_scale_func: Callable | None = doc(None, flag=None)
    moe_grad_scale_func: Callable | None = doc(None, flag=None)
    mtp_grad_scale_func: Callable | None = doc(None, flag=None)
    no_sync_func: Callable | None = doc(None, flag=None)
    grad_sync_func: Callable | None = doc(None, flag=None)
    param_sync_func: Callable | None = doc(None, flag=None)
    deterministic_mode: bool = doc(False, flag=None)
    enable_autocast: bool = doc(False, flag=None)
    autocast_dtype: torch.dtype | None = doc(None, flag=None)
    num_microbatches_with_partial_activation_checkpoints: int | None = doc(None, flag=None)
    gradient_accumulation_fusion: bool = doc(False, flag=None)
    use_te_rng_tracker: bool = doc(False, flag=None)
    tp_comm_overlap: bool = doc(False, flag=None)
    tp_comm_bulk_wgrad: bool = doc(True, flag=None)
    tp_comm_bulk_dgrad: bool = doc(True, flag=None)
    tp_comm_overlap_ag: bool = doc(True, flag=None)
    tp_comm_overlap_rs: bool = doc(True, flag=None)
    tp_comm_overlap_rs_dgrad: bool = doc(False, flag=None)
    tp_comm_split_ag: bool = doc(True, flag=None)
    tp_comm_atomic_ag: bool = doc(False, flag=None)
    tp_comm_split_rs: bool = doc(True, flag=None)
    tp_comm_atomic_rs: bool = doc(False, flag=None)
    cross_entropy_loss_fusion: bool = doc(False, flag=None)
    cross_entropy_fusion_impl: Literal["native", "te"] = doc("native", flag=None)
    tp_comm_overlap_disable_qkv: bool = doc(False, flag=None)
    tp_comm_overlap_disable_fc1: bool = doc(False, flag=None)
    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = doc("nccl", flag=None)
    overlap_moe_expert_parallel_comm: bool = doc(False, flag=None)
    delay_wgrad_compute: bool = doc(False, flag=None)
    overlap_dispatch_backward_with_experts_wgrad: bool = doc(False, flag=None)
    ep_overlap_early_attn_memory_release: bool = doc(False, flag=None)
    pipeline_dtype: torch.dtype | None = doc(None, flag=None)
    variable_seq_lengths: bool = doc(False, flag=None)
    overlap_p2p_comm: bool = doc(False, flag=None)
    batch_p2p_comm: bool = doc(True, flag=None)
    batch_p2p_sync: bool = doc(True, flag=None)
    use_ring_exchange_p2p: bool = doc(False, flag=None)
    deallocate_pipeline_outputs: bool = doc(False, flag=None)
    defer_embedding_wgrad_compute: bool = doc(False, flag=None)
    wgrad_deferral_limit: int = doc(0, flag=None)
    overlap_p2p_comm_warmup_flush: bool = doc(False, flag=None)
    microbatch_group_size_per_vp_stage: int | None = doc(None, flag=None)
    mtp_standalone: bool = doc(False, flag=None)
    cpu_offloading: bool = doc(False, flag=None)
    cpu_offloading_num_layers: int = doc(0, flag=None)
    _cpu_offloading_context: Any = doc(None, flag=None)
    cpu_offloading_activations: bool = doc(True, flag=None)
    cpu_offloading_weights: bool = doc(False, flag=None)
    cpu_offloading_double_buffering: bool = doc(False, flag=None)
    cpu_offloading_retain_pinned_cpu_buffers: bool = doc(False, flag=None)
    barrier_with_L1_time: bool = doc(True, flag=None)

    def __post_init__(self) -> None:
        """Fill the derived defaults and apply Megatron-Core's checks that hold here.

        Raises:
            ConfigError: a refused field (``MPC_REFUSED``) set away from what is built, or one of
                Megatron-Core's inconsistent combinations, naming the field and a valid value.
        """
        check_refused(self, MPC_REFUSED)
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.defer_embedding_wgrad_compute:
            if self.pipeline_model_parallel_size == 1:
                raise ConfigError(
                    "defer_embedding_wgrad_compute=True needs pipeline_model_parallel_size > 1; "
                    "set it to False",
                    params=("defer_embedding_wgrad_compute", "pipeline_model_parallel_size"),
                )
            if not self.gradient_accumulation_fusion:
                raise ConfigError(
                    "defer_embedding_wgrad_compute=True needs gradient_accumulation_fusion=True; "
                    "set one of them accordingly",
                    params=("defer_embedding_wgrad_compute", "gradient_accumulation_fusion"),
                )
            if self.wgrad_deferral_limit < 0:
                raise ConfigError(
                    f"wgrad_deferral_limit must be >= 0, got {self.wgrad_deferral_limit}",
                    params=("wgrad_deferral_limit",),
                )
        if self.overlap_p2p_comm_warmup_flush and (not self.overlap_p2p_comm or self.batch_p2p_comm):
            raise ConfigError(
                "overlap_p2p_comm_warmup_flush=True needs overlap_p2p_comm=True and batch_p2p_comm=False",
                params=("overlap_p2p_comm_warmup_flush", "overlap_p2p_comm", "batch_p2p_comm"),
            )


def check_refused(config: Any, refused: dict[str, tuple[tuple, str]]) -> None:
    """Raise for the first field of ``refused`` whose value is not one of its accepted values.

    Raises:
        ConfigError: ``<Class>.<field>=<value> is not supported here: <what is possible>``.
    """
    for name, (accepted, hint) in refused.items():
        value = getattr(config, name)
        if not any(value is ok or (type(value) is type(ok) and value == ok) for ok in accepted):
            raise ConfigError(
                f"{type(config).__name__}.{name}={value!r} is not supported here: {hint}", params=(name,)
            )


_PERF = "a performance knob of Megatron-Core's CUDA / Transformer Engine paths; no effect here"
_HOOK = "the schedules here do not call this hook; the DDP wrapper and optimizer reduce and gather themselves"

# Fields accepted at any value, with no effect here: field -> why.
MPC_NO_EFFECT: dict[str, str] = {
    "pipeline_model_parallel_comm_backend": "pipeline messages use the process groups' backend (NCCL or gloo)",
    "max_seqlen_per_dp_cp_rank": "only with hybrid_context_parallel, which is refused",
    "expert_tensor_parallel_num_weight_shards": "only with generalized tensor parallelism (GTP), which is refused",
    "expert_gtp_weight_remat_size": "only with generalized tensor parallelism (GTP), which is refused",
    "timers": "timing is the training application's (its own timers); library code does not call it",
    "moe_grad_scale_func": "the schedules scale the auxiliary losses' gradients themselves "
    "(MoEAuxLossAutoScaler: 1 / micro-batches, or 1 with calculate_per_token_loss)",
    "mtp_grad_scale_func": "only with multi-token prediction (mtp_num_layers), which is refused",
    "grad_sync_func": _HOOK,
    "param_sync_func": _HOOK,
    "deterministic_mode": "CPU runs are deterministic; on GPUs the SDPA / cuBLAS choices are not pinned by it",
    "autocast_dtype": "only with enable_autocast, which is refused",
    "num_microbatches_with_partial_activation_checkpoints": "recompute applies to every micro-batch here",
    "gradient_accumulation_fusion": "gradients accumulate into the DDP buffer whatever its value (no APEX kernel)",
    "use_te_rng_tracker": "the RNG tracker is this package's (Transformer Engine is not used)",
    "cross_entropy_fusion_impl": "the fused cross entropy is this package's ('native')",
    "variable_seq_lengths": "pipeline messages carry the shapes of the micro-batch they belong to",
    "batch_p2p_comm": "pipeline messages are posted as the schedule needs them",
    "batch_p2p_sync": "pipeline messages are posted as the schedule needs them",
    "use_ring_exchange_p2p": "pipeline messages use torch.distributed isend / irecv",
    "deallocate_pipeline_outputs": "the schedules free each sent activation when its backward has run",
    "wgrad_deferral_limit": "only with defer_embedding_wgrad_compute",
    "overlap_p2p_comm_warmup_flush": "the interleaved schedule overlaps per overlap_p2p_comm",
    "mtp_standalone": "only with multi-token prediction (mtp_num_layers), which is refused",
    "cpu_offloading": "activations stay on the device (a memory knob)",
    "cpu_offloading_num_layers": "only with cpu_offloading",
    "_cpu_offloading_context": "only with cpu_offloading",
    "cpu_offloading_activations": "only with cpu_offloading",
    "cpu_offloading_weights": "only with cpu_offloading",
    "cpu_offloading_double_buffering": "only with cpu_offloading",
    "cpu_offloading_retain_pinned_cpu_buffers": "only with cpu_offloading",
    "barrier_with_L1_time": "timing is the training application's",
    **{
        name: _PERF
        for name in (
            "tp_comm_overlap",
            "tp_comm_bulk_wgrad",
            "tp_comm_bulk_dgrad",
            "tp_comm_overlap_ag",
            "tp_comm_overlap_rs",
            "tp_comm_overlap_rs_dgrad",
            "tp_comm_split_ag",
            "tp_comm_atomic_ag",
            "tp_comm_split_rs",
            "tp_comm_atomic_rs",
            "tp_comm_overlap_disable_qkv",
            "tp_comm_overlap_disable_fc1",
            "tp_comm_bootstrap_backend",
            "overlap_moe_expert_parallel_comm",
            "delay_wgrad_compute",
            "overlap_dispatch_backward_with_experts_wgrad",
            "ep_overlap_early_attn_memory_release",
            "defer_embedding_wgrad_compute",
        )
    },
}

# Fields refused away from the values built here: field -> (accepted values, what is possible).
MPC_REFUSED: dict[str, tuple[tuple, str]] = {
    "tensor_parallel_num_weight_shards": (
        (None,),
        "generalized tensor parallelism (GTP) is not built; leave it None",
    ),
    "gtp_weight_remat_size": ((1,), "generalized tensor parallelism (GTP) is not built; leave it 1"),
    "hybrid_context_parallel": (
        (False,),
        "hybrid context parallelism is not built; use context_parallel_size",
    ),
    "enable_autocast": (
        (False,),
        "layers compute in params_dtype (fp16 / bf16 via those fields), not under "
        "torch.autocast; leave it False",
    ),
}
