"""OptimizerConfig: which optimizer, its hyper-parameters, gradient clipping and loss scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.config_utils import ConfigError, check_choice, check_positive, doc

OPTIMIZERS = ("adam", "sgd")
# Param-group keys that select kernels for this process's device (each optimizer its own); never taken
# from a checkpoint or copied between optimizers.
KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")

# Megatron-Core fields accepted with no effect here, and why (one line each, for docs/library.md).
NO_EFFECT: dict[str, str] = {
    "params_dtype": "the model's own dtype decides: bf16/fp16 params always get fp32 main copies",
    "fp8_recipe": "FP8 is the model's setting (TransformerConfig.fp8_recipe); main params stay fp32",
    "store_param_remainders": "only with use_precision_aware_optimizer, which is not built",
    "use_distributed_optimizer": "the distributed optimizer is chosen by DistributedDataParallelConfig."
    "use_distributed_optimizer of the model's DDP wrapper",
    "overlap_param_gather": "set on DistributedDataParallelConfig (the DDP wrapper overlaps the gather)",
    "barrier_with_L1_time": "the optimizer step has no internal timers",
    "timers": "the optimizer step has no internal timers",
    "config_logger_dir": "configs are not logged by the optimizer",
}
# Megatron-Core fields whose other values ask for something not built: field -> (the value built, what to do).
REFUSED: dict[str, tuple[Any, str]] = {
    "decoupled_weight_decay": (True, "only AdamW's decoupled weight decay is built; keep True"),
    "apply_wd_to_qk_layernorm": (
        False,
        "1-D params (norm weights, q/k layernorm included) never get weight decay here; keep False",
    ),
    "reuse_grad_buf_for_mxfp8_param_ag": (False, "MXFP8 params are not built; keep False"),
    "use_precision_aware_optimizer": (False, "main params and Adam moments are fp32; keep False"),
    "main_grads_dtype": (torch.float32, "main gradients are fp32; keep torch.float32"),
    "main_params_dtype": (torch.float32, "main params are fp32; keep torch.float32"),
    "exp_avg_dtype": (torch.float32, "Adam moments are fp32; keep torch.float32"),
    "exp_avg_sq_dtype": (torch.float32, "Adam moments are fp32; keep torch.float32"),
    "use_layer_wise_distributed_optimizer": (
        False,
        "only for the emerging optimizers, which are not built; keep False",
    ),
    "overlap_param_gather_with_optimizer_step": (
        False,
        "not built; use DistributedDataParallelConfig.overlap_param_gather; keep False",
    ),
    "optimizer_cuda_graph": (False, "the optimizer step is not CUDA-graphed; keep False"),
}


@dataclass
class OptimizerConfig:
    """Optimizer settings. ``adam`` is AdamW (decoupled weight decay), as in Megatron."""

    optimizer: str = doc("adam", "Optimizer.", choices=OPTIMIZERS)
    lr: float | None = doc(None, "Peak learning rate (after warm-up).")
    # None (Megatron-Core's default) is taken as 0.0, Megatron-LM's --min-lr default.
    min_lr: float | None = doc(0.0, "Learning rate floor at the end of decay.")
    decoupled_lr: float | None = doc(
        None,
        "Peak learning rate of the input embedding and output layer weights (embedding.word_embeddings.weight, "
        "output_layer.weight and its tied copy on the last pipeline stage; not the position embeddings), which then "
        "form param groups of their own on the same warm-up/decay schedule. Default: --lr for every param.",
    )
    decoupled_min_lr: float | None = doc(
        None, "Learning rate floor of the --decoupled-lr params; default --min-lr. Only with --decoupled-lr."
    )
    weight_decay: float = doc(0.01, "Weight decay coefficient (not applied to biases and 1-D params).")
    adam_beta1: float = doc(0.9, "Adam beta1.")
    adam_beta2: float = doc(0.999, "Adam beta2.")
    adam_eps: float = doc(1e-8, "Adam epsilon.")
    sgd_momentum: float = doc(0.9, "SGD momentum. Only with --optimizer sgd.")
    clip_grad: float = doc(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    fp16: bool = doc(False, "Set from --fp16.", flag=None)
    bf16: bool = doc(False, "Set from --bf16.", flag=None)
    loss_scale: float | None = doc(None, "Constant fp16 loss scale (power of 2); default: dynamic scaling.")
    initial_loss_scale: float = doc(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = doc(1.0, "Lowest dynamic loss scale.")
    loss_scale_window: int = doc(1000, "Clean steps before the dynamic loss scale doubles.")
    hysteresis: int = doc(2, "Overflowing steps tolerated before the dynamic loss scale halves.")
    log_num_zeros_in_grad: bool = doc(
        False, "Count zero gradient elements each step (reported as 'num zeros'); costs one extra pass."
    )
    compile_helpers: bool = doc(
        True,
        "On CUDA, run the one-pass AdamW step (use_fused_adam) as torch.compile'd kernels (same values as "
        "eager); the training application takes it from its execution plan (off with --torch-compile off). "
        "No effect on the CPU.",
        flag=None,
    )
    use_fused_adam: bool = doc(
        True, "Use torch's fused/foreach multi-tensor Adam kernels where the device supports them.", flag=None
    )
    grad_norm_skip_threshold: float = doc(
        math.inf,
        "Skip the update (``step()`` returns ``(False, grad_norm, num_zeros)``) when the pre-clip "
        "gradient norm exceeds this; inf: never.",
        flag=None,
    )

    # Megatron-Core 0.19.2's other fields, with its defaults: NO_EFFECT ones are taken and change nothing;
    # REFUSED ones raise ConfigError away from the value built here.
    apply_wd_to_qk_layernorm: bool = doc(False, "Refused if True (see REFUSED).", flag=None)
    fp8_recipe: str | None = doc(None, "No effect (see NO_EFFECT).", flag=None)
    reuse_grad_buf_for_mxfp8_param_ag: bool = doc(False, "Refused if True.", flag=None)
    params_dtype: torch.dtype = doc(torch.float32, "No effect.", flag=None)
    use_precision_aware_optimizer: bool = doc(False, "Refused if True.", flag=None)
    store_param_remainders: bool = doc(True, "No effect.", flag=None)
    main_grads_dtype: torch.dtype = doc(torch.float32, "Refused unless torch.float32.", flag=None)
    main_params_dtype: torch.dtype = doc(torch.float32, "Refused unless torch.float32.", flag=None)
    exp_avg_dtype: torch.dtype = doc(torch.float32, "Refused unless torch.float32.", flag=None)
    exp_avg_sq_dtype: torch.dtype = doc(torch.float32, "Refused unless torch.float32.", flag=None)
    decoupled_weight_decay: bool = doc(True, "Refused if False: AdamW only.", flag=None)
    muon_momentum: float = doc(0.95, "Muon only (not built).", flag=None)
    muon_split_qkv: bool = doc(True, "Muon only (not built).", flag=None)
    muon_nesterov: bool = doc(False, "Muon only (not built).", flag=None)
    muon_scale_mode: str = doc("spectral", "Muon only (not built).", flag=None)
    muon_fp32_matmul_prec: str = doc("medium", "Muon only (not built).", flag=None)
    muon_coefficient_type: str = doc("quintic", "Muon only (not built).", flag=None)
    muon_num_ns_steps: int = doc(5, "Muon only (not built).", flag=None)
    muon_tp_mode: str = doc("blockwise", "Muon only (not built).", flag=None)
    muon_extra_scale_factor: float = doc(1.0, "Muon only (not built).", flag=None)
    muon_scalar_optimizer: str = doc("adam", "Muon only (not built).", flag=None)
    lion_beta1: float = doc(0.95, "Lion only (not built).", flag=None)
    lion_beta2: float = doc(0.98, "Lion only (not built).", flag=None)
    soap_shampoo_beta: float = doc(0.95, "SOAP only (not built).", flag=None)
    soap_precondition_frequency: int = doc(1, "SOAP only (not built).", flag=None)
    soap_use_kl_shampoo: bool = doc(True, "SOAP only (not built).", flag=None)
    adaptive_muon_moment2_method: str = doc("adamuon", "Adaptive Muon only (not built).", flag=None)
    adaptive_muon_beta2: float = doc(0.95, "Adaptive Muon only (not built).", flag=None)
    adaptive_muon_eps: float = doc(1e-8, "Adaptive Muon only (not built).", flag=None)
    use_distributed_optimizer: bool = doc(False, "No effect (see NO_EFFECT).", flag=None)
    use_layer_wise_distributed_optimizer: bool = doc(False, "Refused if True.", flag=None)
    overlap_param_gather: bool = doc(False, "No effect (see NO_EFFECT).", flag=None)
    overlap_param_gather_with_optimizer_step: bool = doc(False, "Refused if True.", flag=None)
    optimizer_cpu_offload: bool = doc(
        False,
        "Keep the fp32 main parameters and optimizer moments of --optimizer-offload-fraction of the "
        "parameters in host memory and run their optimizer step on the CPU (gradients copied to the "
        "host, updated parameters back).",
    )
    optimizer_offload_fraction: float = doc(
        0.0,
        "With --optimizer-cpu-offload: the fraction of the parameters (by elements) offloaded, in [0, 1].",
        app_default=1.0,
    )
    use_torch_optimizer_for_cpu_offload: bool = doc(
        False,
        "With --optimizer-cpu-offload: step the host parameters with torch.optim.AdamW (SGD) as torch builds it "
        "for CPU tensors; default: fused AdamW on the host (the fastest, bench/bench_cpu_adam.py).",
    )
    overlap_cpu_optimizer_d2h_h2d: bool = doc(
        False,
        "With --optimizer-cpu-offload: overlap the gradient copies to the host and the parameter copies "
        "back with the CPU step, group by group (side CUDA streams; no effect on the CPU).",
    )
    pin_cpu_grads: bool = doc(
        True,
        "With --optimizer-cpu-offload: pin the host buffers gradients are copied into (CUDA only); "
        "--no-pin-cpu-grads leaves them pageable.",
    )
    pin_cpu_params: bool = doc(
        True,
        "With --optimizer-cpu-offload: pin the host buffers updated parameters are copied back from (the fp32 "
        "main parameters of an fp32 model; CUDA only); --no-pin-cpu-params leaves them pageable.",
    )
    barrier_with_L1_time: bool = doc(False, "No effect.", flag=None)
    timers: Callable | None = doc(None, "No effect.", flag=None)
    config_logger_dir: str = doc("", "No effect.", flag=None)
    optimizer_cuda_graph: bool = doc(False, "Refused if True.", flag=None)

    def __post_init__(self) -> None:
        if self.min_lr is None:
            self.min_lr = 0.0
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_positive("lr", self.lr, allow_none=True, allow_zero=True)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        check_positive("decoupled_lr", self.decoupled_lr, allow_none=True, allow_zero=True)
        check_positive("decoupled_min_lr", self.decoupled_min_lr, allow_none=True, allow_zero=True)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("clip_grad", self.clip_grad, allow_zero=True)
        check_positive("adam_eps", self.adam_eps)
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {v}", params=(name,))
        check_positive("loss_scale", self.loss_scale, allow_none=True)
        check_positive("initial_loss_scale", self.initial_loss_scale)
        check_positive("min_loss_scale", self.min_loss_scale)
        check_positive("loss_scale_window", self.loss_scale_window)
        check_positive("hysteresis", self.hysteresis)
        if self.fp16 and self.loss_scale is None and self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"min_loss_scale ({self.min_loss_scale}) must be <= initial_loss_scale "
                f"({self.initial_loss_scale})",
                params=("min_loss_scale", "initial_loss_scale"),
            )
        if not self.grad_norm_skip_threshold > 0:
            raise ConfigError(
                f"grad_norm_skip_threshold must be > 0 (inf: never skip), got "
                f"{self.grad_norm_skip_threshold}",
                params=("grad_norm_skip_threshold",),
            )
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ConfigError(
                f"optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}",
                params=("optimizer_offload_fraction",),
            )
        for name, (built, why) in REFUSED.items():
            if getattr(self, name) != built:
                raise ConfigError(
                    f"OptimizerConfig.{name}={getattr(self, name)!r} is not supported here: {why}",
                    params=(name,),
                )
