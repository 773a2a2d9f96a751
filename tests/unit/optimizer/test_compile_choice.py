"""The one-pass AdamW step runs compiled or eager as OptimizerConfig.compile_helpers says."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, fused_adamw, get_megatron_optimizer


@pytest.mark.parametrize("compile_helpers", [True, False])
def test_adamw_step_takes_the_configured_compile_choice(monkeypatch, compile_helpers: bool) -> None:
    seen: set[bool] = set()

    def recording(real):
        def call(*args: torch.Tensor, compile: bool) -> None:
            seen.add(compile)
            real(*args, compile=compile)

        return call

    kernels = {k: tuple(recording(f) for f in fns) for k, fns in fused_adamw.KERNELS.items()}
    monkeypatch.setattr(fused_adamw, "KERNELS", kernels)
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, bf16=True, compile_helpers=compile_helpers), [model])
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    for p in model.parameters():
        p.main_grad = p.grad.float()
    opt.step()
    assert seen == {compile_helpers}
