"""OptimizerConfig: which optimizer, its hyper-parameters, gradient clipping and loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config_utils import check_choice, check_positive, doc

OPTIMIZERS = ("adam", "sgd")


@dataclass
class OptimizerConfig:
    """Optimizer settings. ``adam`` is AdamW (decoupled weight decay), as in Megatron."""

    optimizer: str = doc("adam", "Optimizer.", choices=OPTIMIZERS)
    lr: float | None = doc(None, "Peak learning rate (after warm-up).")
    min_lr: float = doc(0.0, "Learning rate floor at the end of decay.")
    decoupled_lr: float | None = doc(
        None, "Peak learning rate of the input embedding and output layer weights (embedding.word_embeddings.weight, "
        "output_layer.weight and its tied copy on the last pipeline stage; not the position embeddings), which then "
        "form param groups of their own on the same warm-up/decay schedule. Default: --lr for every param.")
    decoupled_min_lr: float | None = doc(
        None, "Learning rate floor of the --decoupled-lr params; default --min-lr. Only with --decoupled-lr.")
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
    use_fused_adam: bool = doc(
        True, "Use torch's fused/foreach multi-tensor Adam kernels where the device supports them.", flag=None
    )

    def __post_init__(self) -> None:
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
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {v}")
        check_positive("loss_scale", self.loss_scale, allow_none=True)
        check_positive("initial_loss_scale", self.initial_loss_scale)
        check_positive("min_loss_scale", self.min_loss_scale)
        check_positive("loss_scale_window", self.loss_scale_window)
        check_positive("hysteresis", self.hysteresis)
