"""Shared helpers for optimizer tests: a tiny model, deterministic batches, a training loop."""

from __future__ import annotations

import io

import pytest
import torch

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer


class TinyMLP(torch.nn.Module):
    """fc1 -> layernorm -> gelu -> fc2: 2-D weights, biases and a 1-D norm weight."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
        with torch.no_grad():  # non-trivial norm params so they train visibly
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.1, 0.1)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, 8] -> [b, 4]
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 4, generator=g)
    return x.to(dtype), y


def train_steps(
    model: torch.nn.Module, opt: MegatronOptimizer, steps: range, use_main_grad: bool = False, scheduler=None
) -> list:
    """Forward/backward/step; with ``use_main_grad`` emulate DDP's fp32 ``main_grad`` buffers."""
    dtype = next(model.parameters()).dtype
    results = []
    for step in steps:
        x, y = batch(step, dtype)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.scale_loss(loss).backward()
        if use_main_grad:
            for p in model.parameters():
                if getattr(p, "main_grad", None) is None:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.main_grad.add_(p.grad.float())
                p.grad = None
        results.append(opt.step())
        if scheduler is not None and results[-1][0]:
            scheduler.step(32)
        opt.zero_grad()
    return results


def roundtrip(obj):
    """Serialise and deserialise as a separate process would see it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.fixture
def tools():
    return {
        "TinyMLP": TinyMLP,
        "batch": batch,
        "train_steps": train_steps,
        "roundtrip": roundtrip,
        "make": lambda model, **kw: get_megatron_optimizer(OptimizerConfig(**kw), [model]),
    }
