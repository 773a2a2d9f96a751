"""The FP8 compute of one linear (:class:`Fp8Gemm`, an ``nn.Module`` holding the scaling state) and
delayed scaling's amax reduction across ranks (:class:`AmaxReducer`, owned by the trainer)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.fusions.fp8.gemm import Fp8MatmulDelayed, fp8_forward_only, fp8_matmul
from megatron.core.fusions.fp8.recipe import ALIGN, Fp8Recipe
from megatron.core.fusions.fp8.scaling import push_amaxes
from megatron.core.fusions.fp8.torchao import TorchaoMatmul, torchao_matmul
from megatron.core.fusions.triton import NO_KERNELS, TritonKernels


class AmaxReducer:
    """Delayed scaling across ranks (Megatron's amax reduction group): the amaxes of every FP8 GEMM a
    backward pass went through are reduced (max) over ``group`` in one all-reduce when that backward
    ends, then enter the histories. The histories still advance before the next forward reads them,
    so every scale is the one a reduction per linear gives; nothing in the same backward reads a
    history that moved. Built by the trainer (one per group) and given to the GEMMs it reduces for."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.pending: list[tuple[Fp8Gemm, torch.Tensor]] = []
        self.task = -2  # the autograd graph task whose end runs flush (-2: none queued)

    def add(self, gemm: Fp8Gemm, amaxes: torch.Tensor) -> None:
        """Queue ``amaxes`` ([x, w, dY]) of ``gemm`` for the reduction at the end of this backward."""
        self.pending.append((gemm, amaxes))
        task = torch._C._current_graph_task_id()
        if task != self.task:  # first GEMM of this backward (or one that failed before its end)
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    @torch.no_grad()
    def flush(self) -> None:
        """One all-reduce (max) of every queued amax, each then pushed into its GEMM's history."""
        pending, self.pending, self.task = self.pending, [], -2
        if not pending:
            return
        stacked = torch.stack([amaxes for _, amaxes in pending])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=self.group)
        for (gemm, _), row in zip(pending, stacked):
            gemm.push_amaxes(row)


class Fp8Gemm(nn.Module):
    """The FP8 compute of one linear (held as its ``fp8`` submodule): scaling state, no weights.

    The amax history is a non-persistent buffer (``[3, L]`` rows X, W, dY): the model's state dict
    does not change; checkpoints hold it apart (:func:`fp8_sharded_state_dict`). With delayed scaling
    the amaxes of a forward/backward arrive as the gradient of ``amax_sink`` (see
    :class:`Fp8MatmulDelayed`), a plain ``[3]`` tensor (not a parameter: no optimizer, no
    data-parallel reduction sees it).

    Args:
        recipe: the run's recipe.
        device: where the scaling state lives (the linear's weight's device).
        use_scaled_mm: ``torch._scaled_mm`` (Hopper); False: fp32 GEMMs on the dequantised values
            (FP8 emulated on the CPU, tests).
        reducer: delayed scaling's amax reduction over the ranks that must share the scales (the
            tensor-, context- and data-parallel ranks of the stage, or the tensor-parallel ones);
            None: this rank's own amaxes.
        kernels: the Triton kernels of the run (``fp8_cast`` quantises by the Triton kernels).
    """

    amax_history: torch.Tensor
    initialized: torch.Tensor

    def __init__(
        self,
        recipe: Fp8Recipe,
        *,
        device: torch.device | str | None = None,
        use_scaled_mm: bool = True,
        reducer: AmaxReducer | None = None,
        kernels: TritonKernels = NO_KERNELS,
    ) -> None:
        super().__init__()
        self.recipe = recipe
        self.use_scaled_mm = use_scaled_mm
        self.reducer = reducer
        self.kernels = kernels
        self.use_triton = kernels.uses("fp8_cast")
        length = recipe.amax_history_len if recipe.recipe == "delayed" else 1
        self.register_buffer("amax_history", torch.zeros(3, length, device=device), persistent=False)
        self.register_buffer("initialized", torch.zeros(3, dtype=torch.bool, device=device), persistent=False)
        self.amax_sink: torch.Tensor | None = None
        self.warm = False  # delayed scaling: the history has entries (set by the hook; see Fp8MatmulDelayed)
        if recipe.recipe == "delayed":
            self._make_sink(self.amax_history.device)
        self._torchao: TorchaoMatmul | None = (
            torchao_matmul(recipe, emulate=not use_scaled_mm) if recipe.gemm_impl == "torchao" else None
        )

    def _make_sink(self, device: torch.device) -> None:
        self.amax_sink = torch.zeros(3, device=device, requires_grad=True)
        self.amax_sink.register_post_accumulate_grad_hook(self._record_amaxes)

    @torch.no_grad()
    def _record_amaxes(self, sink: torch.Tensor) -> None:
        """After each backward through this GEMM: its forward's x / w amaxes and the gradient's amax
        (with a reducer, reduced together with the other GEMMs' when the backward ends)."""
        if sink.grad is not None:
            if self.reducer is not None:
                self.reducer.add(self, sink.grad)
            else:
                self.push_amaxes(sink.grad)
            sink.grad = None

    @torch.no_grad()
    def reset_scaling_state_(self) -> None:
        """Empty amax history (a freshly allocated module's buffers hold whatever ``to_empty`` left)."""
        self.amax_history.zero_()
        self.initialized.zero_()

    @torch.no_grad()
    def push_amaxes(self, amaxes: torch.Tensor) -> None:
        """``amaxes`` ([x, w, dY]) into the history."""
        push_amaxes(self.amax_history, self.initialized, amaxes)
        self.warm = True

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)  # .to() / .cuda(): the sink follows the buffers
        if self.amax_sink is not None and self.amax_sink.device != self.amax_history.device:
            self._make_sink(self.amax_history.device)
        return out

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[..., K] -> [..., N]``; ``F.linear`` (with a warning) for a token count not a multiple of 16."""
        x2d = x.reshape(-1, x.shape[-1])  # [M, K]
        if x2d.shape[0] % ALIGN != 0:
            warnings.warn(
                f"FP8: {x2d.shape[0]} tokens per GEMM is not a multiple of {ALIGN}; "
                "those GEMMs run in bf16 (use a micro-batch x sequence length divisible by 16)",
                stacklevel=2,
            )
            return F.linear(x, weight, bias)
        if self._torchao is not None:
            out = self._torchao(x2d, weight)
        elif not torch.is_grad_enabled():
            out = fp8_forward_only(
                x2d, weight, self.recipe, self.amax_history, self.initialized, self.warm, self.use_scaled_mm
            )
        elif self.recipe.recipe == "delayed":
            out = Fp8MatmulDelayed.apply(
                x2d,
                weight,
                self.amax_sink,
                self.amax_history,
                self.initialized,
                self.recipe,
                self.use_scaled_mm,
                self.warm,
                self.use_triton,
            )
        else:
            out = fp8_matmul(x2d, weight, self.recipe, self.use_scaled_mm, self.use_triton)
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out + bias if bias is not None else out
