"""AdamW over fp32 main params that also writes the bf16/fp16 model copy, one pass per tensor.

torch's fused AdamW updates the fp32 main params; a mixed-precision step then needs a second pass
to copy them into the model's bf16 params, and clipping through its ``grad_scale`` makes it write the
unscaled gradients back. Per parameter this kernel reads the fp32 param, gradient, ``exp_avg`` and
``exp_avg_sq`` once and writes the param, both moments and the model copy: 30 bytes per parameter
instead of about 42.

The update is torch's AdamW (decoupled weight decay, bias corrections, ``eps`` outside the square
root), in fp32, with the gradient divided by the clipping divisor as it is read. Hyper-parameters
and the step count are device tensors, so the learning-rate schedule never recompiles and nothing
waits for the host. The state lives in the wrapped ``torch.optim.AdamW`` (``step``, ``exp_avg``,
``exp_avg_sq``), so checkpoints are unchanged. On CUDA the per-tensor function is compiled once
(``torch.compile(dynamic=True)`` over flat views: one graph for every size); elsewhere it runs eagerly
with the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.fusions.compile import maybe_compiled


def _update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: torch.Tensor,
    divisor: torch.Tensor,
) -> torch.Tensor:
    """One AdamW step of a flat fp32 ``param`` in place; returns the new param (for the model copy).

    ``hyper`` is ``[lr, weight_decay, beta1, beta2, eps, keep]`` (fp32, on the param's device).
    ``keep`` 0 skips the step exactly on the device (a rejected step, decided without a host sync):
    the param, both moments and the step count keep their bits, even where the gradient is NaN.
    """
    lr, wd, beta1, beta2, eps, keep = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5]
    step.add_(keep)
    g = torch.where(keep > 0, grad.float() / divisor, 0.0)
    param.mul_(1.0 - lr * wd * keep)
    exp_avg.lerp_(g, (1.0 - beta1) * keep)
    exp_avg_sq.mul_(torch.where(keep > 0, beta2, 1.0)).add_((1.0 - beta2) * keep * g * g)
    counted = torch.clamp(step, min=1.0)  # a first step skipped: no 0 / 0 below
    bias_correction1 = 1.0 - torch.pow(beta1, counted)
    bias_correction2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, counted))
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.sub_((lr * keep / bias_correction1) * exp_avg / denom)
    return param


def _update_main(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: torch.Tensor,
    divisor: torch.Tensor,
) -> None:
    _update(param, grad, exp_avg, exp_avg_sq, step, hyper, divisor)


def _update_main_and_model(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: torch.Tensor,
    divisor: torch.Tensor,
    model_param: torch.Tensor,
) -> None:
    model_param.copy_(_update(param, grad, exp_avg, exp_avg_sq, step, hyper, divisor))


# Static shapes: one compiled kernel per distinct tensor size (a handful per model), each with the
# alignment and size known to the compiler (vectorised loads); dynamic=True makes one graph for all.
KERNELS = {
    dynamic: (
        maybe_compiled(_update_main, dynamic=dynamic),
        maybe_compiled(_update_main_and_model, dynamic=dynamic),
    )
    for dynamic in (False, True)
}


def _hyper(group: dict, device: torch.device, skip: torch.Tensor | None = None) -> torch.Tensor:
    """The group's [lr, weight_decay, beta1, beta2, eps, keep] on ``device`` without a blocking copy;
    ``keep`` is 1 - ``skip`` (a 0-dim device flag) or 1."""
    beta1, beta2 = group["betas"]
    values = torch.tensor(
        [group["lr"], group["weight_decay"], beta1, beta2, group["eps"], 1.0], dtype=torch.float32
    )
    if device.type == "cuda":
        values = values.pin_memory().to(device, non_blocking=True)
    else:
        values = values.to(device)
    if skip is not None:
        values[5] = 1.0 - skip.to(device=device, dtype=torch.float32)
    return values


@torch.no_grad()
def adamw_step(
    optimizer: torch.optim.Optimizer,
    model_params: Mapping[int, torch.Tensor],
    divisor: torch.Tensor | None,
    dynamic: bool = False,
    grads: Mapping[int, torch.Tensor] | None = None,
    compile: bool = True,
    skip: torch.Tensor | None = None,
) -> None:
    """Step every param of ``optimizer`` that has a gradient (``grads``, else ``.grad``).

    Args:
        optimizer: a ``torch.optim.AdamW`` whose params are the fp32 main params (amsgrad off).
        model_params: ``id(main param) -> model param`` for main params that have a lower-precision
            model copy to refresh; main params absent here are the model params themselves.
        divisor: 0-dim fp32 device tensor the gradients are divided by (clipping), or None.
        dynamic: compile one size-generic kernel instead of one per tensor size.
        grads: ``id(main param) -> gradient`` (any float dtype, read in fp32) replacing ``.grad``.
        compile: run the compiled kernels on CUDA (``OptimizerConfig.compile_helpers``); eager otherwise.
        skip: 0-dim device flag (1: leave every param, moment and step count as it is), or None.
    """
    update_main, update_main_and_model = KERNELS[dynamic]
    if grads is None:
        grads = {
            id(p): p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        }
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in grads]
        if not params:
            continue
        if group.get("amsgrad") or group.get("maximize"):
            raise ConfigError(
                "the fused AdamW step supports neither amsgrad nor maximize; set both to False",
                params=("amsgrad", "maximize"),
            )
        device = params[0].device
        hyper = _hyper(group, device, skip)
        div = divisor if divisor is not None else torch.ones((), dtype=torch.float32, device=device)
        for p in params:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = state["step"]
            if step.device != device:  # a checkpoint from a non-fused run keeps it on the host
                step = state["step"] = step.to(device=device, dtype=torch.float32)
            args = (
                p.view(-1),
                grads[id(p)].view(-1),
                state["exp_avg"].view(-1),
                state["exp_avg_sq"].view(-1),
                step,
                hyper,
                div,
            )
            model = model_params.get(id(p))
            if model is None:
                update_main(*args, compile=compile)
            else:
                update_main_and_model(*args, model.view(-1), compile=compile)
