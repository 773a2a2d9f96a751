"""The execution plan: which implementation each part of a run uses, decided once at start-up.

:func:`resolve` reads the configuration, the device and the Triton kernels' self-check results and
returns one frozen :class:`ExecutionPlan`. Everything that dispatches reads that object and nothing
else: the layer specs (``models.gpt.gpt_layer_specs.get_gpt_decoder_block_plan_spec``) turn it into
the modules each layer is built from, ``GPTModel(execution_plan=...)`` takes its output layer + loss
path from it, the trainer compiles the layers when it says so, and the start-up report
(``fusions.kernels.kernel_report``) prints it. ``forward`` methods call what they were built with.

A plan built without :func:`resolve` (``ExecutionPlan.plain(config)``) is Megatron-Core's local
layer: torch code everywhere, nothing compiled, no FP8, no Triton.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.fusions.fp8 import (
    ALIGN,
    FP8_LINEAR_NAMES,
    AmaxReducer,
    Fp8Gemm,
    Fp8Recipe,
    bf16_layer_numbers,
    fp8_device_error,
    swiglu_mlp_fusable,
)
from megatron.core.fusions.kernels import kernel_report, sdpa_backend
from megatron.core.fusions.triton import KERNELS, TritonKernels, self_check
from megatron.core.transformer.moe_config_fields import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig

# The SwiGLU activation: the torch ops (autograd's backward), or the autograd function whose backward
# is one Triton kernel (``fusions.triton_kernels.SwiGLU``).
SWIGLU_IMPLS = ("torch", "triton")
# The output layer + loss: fused and chunked over tokens (its per-row pass a Triton kernel, compiled
# torch ops, or eager torch ops), vocab-parallel cross entropy over tp-sharded logits, or the full logits.
CROSS_ENTROPY_PATHS = ("fused_triton", "fused_compiled", "fused_eager", "vocab_parallel", "unfused")


@dataclass(frozen=True)
class Fp8Plan:
    """Which GEMMs run in FP8 and how.

    Attributes:
        recipe: format, scaling and GEMM implementation.
        emulated: fp32 GEMMs on the dequantised fp8 values (CPU tests; no ``torch._scaled_mm``).
        layers: the global 1-based numbers of the transformer layers whose linears run in FP8
            (``first_last_layers_bf16`` keeps the others in the model's dtype).
        linears: the linears of those layers that run in FP8 (their local weight dims are multiples
            of ``ALIGN``); ``unaligned`` names the others with their local shape.
        swiglu_block: the FP8 layers' MLPs run fc1 -> SwiGLU -> fc2 as one FP8 block
            (``transformer.mlp.Fp8SwigluMLP``).
    """

    recipe: Fp8Recipe
    emulated: bool
    layers: frozenset[int]
    linears: tuple[str, ...]
    unaligned: tuple[str, ...] = ()
    swiglu_block: bool = False

    def runs(self, layer_number: int, linear: str) -> bool:
        """Whether ``linear`` (a name of FP8_LINEAR_NAMES) of layer ``layer_number`` runs in FP8."""
        return layer_number in self.layers and linear in self.linears


@dataclass(frozen=True)
class Fp8GemmBuilder:
    """Builds the :class:`Fp8Gemm` of one linear (a layer spec's ``fp8_gemm`` parameter of the
    column/row-parallel linears); every linear gets its own scaling state."""

    recipe: Fp8Recipe
    use_scaled_mm: bool
    kernels: TritonKernels
    reducer: AmaxReducer | None = dataclasses.field(default=None, compare=False)

    def __call__(self, device: torch.device | str | None) -> Fp8Gemm:
        return Fp8Gemm(
            self.recipe,
            device=device,
            use_scaled_mm=self.use_scaled_mm,
            reducer=self.reducer,
            kernels=self.kernels,
        )


@dataclass(frozen=True)
class ExecutionPlan:
    """Every implementation choice of one run (see the module docstring).

    Attributes:
        config: the model configuration the plan was resolved from (read, never changed).
        device_type: ``"cuda"``, ``"cpu"`` or ``"meta"``.
        tp_size: tensor-parallel size the shapes were resolved for.
        attention: the core attention module: ``"sdpa"`` (``F.scaled_dot_product_attention``) or
            ``"context_parallel"`` (the config's ``context_parallel_size`` > 1:
            ``context_parallel.attention.ContextParallelAttention`` with the config's ``cp_comm_type``).
        attention_kernel: the SDPA backend picked for this model's shapes (a probe at start-up).
        swiglu: one of SWIGLU_IMPLS (the SwiGLU activation; unused for GELU).
        cross_entropy: one of CROSS_ENTROPY_PATHS.
        compile_layers: ``torch.compile`` each transformer layer; ``compile_reason`` says why not.
        compile_helpers: ``torch.compile`` the fused cross entropy's small helpers (CUDA, compile on).
        triton_checks: the Triton kernels' self-check results: ``(name, None)`` passed, else
            ``(name, why it does not run)``, for every name of ``fusions.triton_kernels.KERNELS``.
        interpret: Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1``).
        fp8: the FP8 GEMMs, or None (every GEMM in the model's dtype).
        moe_layers: the global 1-based numbers of the layers whose MLP is an ``MoELayer`` (the
            config's ``num_moe_experts`` with ``moe_layer_freq``'s pattern); empty for a dense model.
    """

    config: TransformerConfig = dataclasses.field(compare=False, repr=False)
    device_type: str = "cpu"
    tp_size: int = 1
    attention: str = "sdpa"
    attention_kernel: str = "SDPA"
    swiglu: str = "torch"
    cross_entropy: str = "unfused"
    compile_layers: bool = False
    compile_reason: str = "not asked"
    compile_helpers: bool = False
    triton_checks: tuple[tuple[str, str | None], ...] = ()
    interpret: bool = False
    fp8: Fp8Plan | None = None
    moe_layers: frozenset[int] = frozenset()

    @classmethod
    def plain(cls, config: TransformerConfig, tp_size: int = 1) -> ExecutionPlan:
        """Megatron-Core's local layer: torch code, no compile, no FP8; the cross entropy fused
        (eager) where ``config.cross_entropy_loss_fusion`` asks and one rank holds the vocabulary."""
        return cls(
            config=config,
            tp_size=tp_size,
            attention="context_parallel" if getattr(config, "context_parallel_size", 1) > 1 else "sdpa",
            cross_entropy=_cross_entropy_path(config, tp_size, "cpu", False, False),
            triton_checks=tuple((k, "no self-check was run (a plan without resolve())") for k in KERNELS),
            moe_layers=moe_layer_numbers(config),
        )

    @property
    def kernels(self) -> TritonKernels:
        """The Triton kernels this run dispatches to (those whose self-check passed)."""
        return TritonKernels(
            enabled=frozenset(k for k, why in self.triton_checks if why is None), interpret=self.interpret
        )

    def triton_reason(self, kernel: str) -> str | None:
        """Why ``kernel`` does not run (None: it passed its self-check and runs)."""
        return dict(self.triton_checks).get(kernel, "not checked")

    @property
    def fused_cross_entropy(self) -> bool:
        return self.cross_entropy.startswith("fused")

    def fp8_gemm_builder(self, reducer: AmaxReducer | None = None) -> Fp8GemmBuilder | None:
        """The builder of the FP8 linears' GEMMs (None without FP8); ``reducer``: delayed scaling's
        amax reduction across ranks, owned by the caller (None: each rank its own amaxes)."""
        if self.fp8 is None:
            return None
        return Fp8GemmBuilder(
            self.fp8.recipe, use_scaled_mm=not self.fp8.emulated, kernels=self.kernels, reducer=reducer
        )

    def report_lines(
        self, optimizer_config: object = None, fp8_linears: int | None = None, documents: bool = False
    ) -> list[str]:
        """The ``> kernels`` block printed at start-up: this plan, in words (``fp8_linears``: the FP8
        GEMMs built on this rank, to print beside it; ``documents``: packed-document attention)."""
        return kernel_report(self, optimizer_config, fp8_linears, documents)


def resolve(
    config: TransformerConfig,
    device: torch.device | str,
    tp_size: int = 1,
    *,
    torch_compile: bool = True,
    compile_off_reason: str = "--torch-compile off",
    triton_checks: Mapping[str, str | None] | None = None,
    interpret: bool = False,
    fp8_emulate: bool = False,
    self_check_fn: Callable[..., dict[str, str | None]] = self_check,
) -> ExecutionPlan:
    """The plan of a run of ``config`` on ``device`` with ``tp_size`` tensor-parallel ranks.

    Args:
        torch_compile: compile the layers and helpers on CUDA (``compile_off_reason`` is reported
            when this is False).
        triton_checks: the self-check results to use; default: run ``self_check_fn(device,
            interpret)`` now (``fusions.triton_kernels.self_check``).
        interpret / fp8_emulate: ``TRITON_INTERPRET=1`` and ``MEGATRON_FP8_EMULATE=1`` as the caller
            read them at start-up.

    Raises:
        ConfigError: FP8 is asked (``fp8_format``) and ``device`` cannot run it.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    checks = dict(self_check_fn(device, interpret) if triton_checks is None else triton_checks)
    passed = {k for k in KERNELS if k in checks and checks[k] is None}
    reason = "" if cuda and torch_compile else ("CPU run" if not cuda else compile_off_reason)
    context_parallel = getattr(config, "context_parallel_size", 1) > 1
    if context_parallel and not reason:
        # Not compiled: the layer would break its graph at every key/value exchange, and compiled
        # layers with context parallelism have not run on several GPUs here.
        reason = "context parallelism (its attention exchanges keys and values between ranks)"
    # MoE layers compile too: their MoELayer runs outside the layer's graph (the tokens each expert
    # gets change every step) with its own compiled kernels (compile_helpers).
    moe_layers = moe_layer_numbers(config)
    helpers = cuda and torch_compile
    swiglu = "triton" if config.activation == "swiglu" and cuda and "swiglu" in passed else "torch"
    n_q, n_kv = config.num_attention_heads // tp_size, max(1, _known(config.num_query_groups) // tp_size)
    probe = (
        sdpa_backend(device, config.params_dtype, n_q, n_kv, _known(config.kv_channels))
        if device.type != "meta"
        else "SDPA (not probed on the meta device)"
    )
    return ExecutionPlan(
        config=config,
        device_type=device.type,
        tp_size=tp_size,
        attention="context_parallel" if context_parallel else "sdpa",
        attention_kernel=probe,
        swiglu=swiglu,
        cross_entropy=_cross_entropy_path(config, tp_size, device.type, "cross_entropy" in passed, helpers),
        compile_layers=not reason,
        compile_reason=reason,
        compile_helpers=helpers,
        triton_checks=tuple((k, checks.get(k, "not checked")) for k in KERNELS),
        interpret=interpret,
        fp8=_fp8_plan(config, device, tp_size, fp8_emulate and device.type == "cpu"),
        moe_layers=moe_layers,
    )


def moe_layer_numbers(config: TransformerConfig) -> frozenset[int]:
    """The global 1-based numbers of the MoE layers of ``config`` (``moe_layer_pattern``)."""
    return frozenset(i + 1 for i, moe in enumerate(moe_layer_pattern(config)) if moe)


def _known(value: int | None) -> int:
    """A size ``TransformerConfig.__post_init__`` has derived (never None after it)."""
    assert value is not None
    return value


def _cross_entropy_path(
    config: TransformerConfig, tp_size: int, device_type: str, triton: bool, compiled: bool
) -> str:
    if not config.cross_entropy_loss_fusion:
        return "vocab_parallel" if tp_size > 1 else "unfused"
    if tp_size > 1:
        return "vocab_parallel"
    if device_type == "cuda" and triton:
        return "fused_triton"
    return "fused_compiled" if compiled else "fused_eager"


def fp8_local_shapes(config: TransformerConfig, tp_size: int) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of the local weight of each FP8_LINEAR_NAMES linear on one of ``tp_size`` ranks."""
    d, h = _known(config.kv_channels), config.hidden_size
    n_h, n_g = config.num_attention_heads, _known(config.num_query_groups)
    ffn = _known(config.ffn_hidden_size)
    gated = 2 if config.activation == "swiglu" else 1
    return {
        "linear_qkv": ((n_h + 2 * n_g) * d // tp_size, h),
        "linear_proj": (h, n_h * d // tp_size),
        "linear_fc1": (gated * ffn // tp_size, h),
        "linear_fc2": (h, ffn // tp_size),
    }


def _fp8_plan(
    config: TransformerConfig, device: torch.device, tp_size: int, emulated: bool
) -> Fp8Plan | None:
    """The FP8 part of the plan (None without ``fp8_format``); warns once about what stays in bf16."""
    recipe = Fp8Recipe.from_config(config)
    if recipe is None:
        return None
    if device.type != "meta":
        error = fp8_device_error(device, emulated)
        if error:
            raise ConfigError(error, params=("fp8_format",))
    shapes = fp8_local_shapes(config, tp_size)
    aligned = tuple(n for n in FP8_LINEAR_NAMES if shapes[n][0] % ALIGN == 0 and shapes[n][1] % ALIGN == 0)
    unaligned = tuple(f"{n} {list(shapes[n])}" for n in FP8_LINEAR_NAMES if n not in aligned)
    if unaligned:
        warnings.warn(
            f"FP8: the linears {', '.join(unaligned)} keep bf16 GEMMs because a weight dim is not a "
            f"multiple of {ALIGN}",
            stacklevel=3,
        )
    if emulated:
        warnings.warn(
            "FP8 emulated on the CPU: fp32 GEMMs on the dequantised fp8 values, for tests only", stacklevel=3
        )
    in_bf16 = bf16_layer_numbers(config)
    layers = frozenset(i for i in range(1, config.num_layers + 1) if i not in in_bf16)
    block = swiglu_mlp_fusable(config) and "linear_fc1" in aligned and "linear_fc2" in aligned
    return Fp8Plan(recipe, emulated, layers, aligned, unaligned, block)
