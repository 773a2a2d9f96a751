"""``--fp8-gemm-impl torchao``: the tensorwise recipe's GEMMs by torchao's float8 training
(``matmul_with_hp_or_float8_args``, the function behind its ``Float8Linear``): the same quantisation,
torchao's choices of what to save for backward and of fast accumulation in the forward GEMM. It is
there to choose the faster implementation by measurement (docs/performance.md); torchao is optional."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron.core.fusions.fp8.recipe import Fp8Recipe

TorchaoMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torchao_matmul(recipe: Fp8Recipe, emulate: bool) -> TorchaoMatmul:
    """``(x2d, weight) -> x2d @ weight.T`` through torchao's float8 training, tensorwise scaling, with
    ``recipe``'s formats (``emulate``: dequantised fp32 GEMMs, for devices without FP8)."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    grads = {
        f: dataclasses.replace(getattr(config, f), target_dtype=recipe.bwd_dtype)
        for f in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
    }
    config = dataclasses.replace(config, emulate=emulate, **grads)
    mm = LinearMMConfig(
        *(
            ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim)
            for g in (
                config.gemm_config_output,
                config.gemm_config_grad_input,
                config.gemm_config_grad_weight,
            )
        )
    )

    def matmul(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = matmul_with_hp_or_float8_args.apply(x2d, weight.t(), mm, config)
        return out

    return matmul
