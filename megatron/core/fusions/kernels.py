"""The start-up report of which kernels a run uses, and why a faster one is not in use.

:func:`kernel_report` prints an :class:`~megatron.core.execution_plan.ExecutionPlan`, the object the
layers were built from: it never decides anything itself. :func:`sdpa_backend` is the probe the plan
records for attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the plan imports this module for its report
    from megatron.core.execution_plan import ExecutionPlan

_SDPA_NAMES = {0: "math (unfused)", 1: "flash", 2: "memory-efficient", 3: "cuDNN fused attention"}
_SHORT = {"linear_qkv": "QKV", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def sdpa_backend(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, causal: bool = True
) -> str:
    """The backend ``F.scaled_dot_product_attention`` picks for these shapes (a tiny probe call)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "SDPA (backend not reported by this torch)"
    try:
        q = torch.zeros(1, num_heads, 128, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(1, num_kv, 128, head_dim, device=device, dtype=dtype)
        kwargs = {"is_causal": causal}
        if num_kv != num_heads:
            kwargs["enable_gqa"] = True
        idx = int(choose(q, kv, kv, **kwargs))
    except Exception as exc:  # noqa: BLE001 - report, never fail the run over a probe
        return f"SDPA (backend probe failed: {type(exc).__name__})"
    return f"SDPA -> {_SDPA_NAMES.get(idx, f'backend {idx}')}"


def _half(plan: ExecutionPlan) -> bool:
    """Whether attention runs in fp16/bf16 on CUDA (the fused kernels' dtypes)."""
    cfg = plan.config
    return plan.device_type == "cuda" and (cfg.bf16 or cfg.fp16)


def kernel_report(
    plan: ExecutionPlan, optimizer_config: Any = None, fp8_linears: int | None = None, documents: bool = False
) -> list[str]:
    """Lines for the ``> kernels`` block printed at start-up: ``plan`` in words. ``fp8_linears``: the
    FP8 GEMMs the plan's layer specs built on this rank (None: not counted); ``documents``: attention
    is document-masked (packed sequences)."""
    cuda = plan.device_type == "cuda"
    attn = plan.attention_kernel
    if not cuda:
        attn += " (the CPU kernel of that name; cuDNN fused attention needs a CUDA device)"
    if documents and plan.attention != "context_parallel":
        attn = (
            "document-masked: variable-length flash attention over the packed documents (outside the "
            "compiled layer graphs)"
            if _half(plan)
            else f"document-masked: SDPA with the documents' dense mask ({attn})"
        )
    if plan.attention == "context_parallel":
        types = plan.config.cp_comm_type or "p2p"
        types = types if isinstance(types, str) else ", ".join(dict.fromkeys(types))
        blocks = (
            "cuDNN attention (Hopper and newer; flash attention elsewhere) for unmasked and causal "
            "blocks, memory-efficient attention with the "
            "block's mask for document-masked ones"
            if _half(plan)
            else "fp32 math blocks"
        )
        attn = (
            f"context-parallel ({types}) over cp {plan.config.context_parallel_size}, blockwise with "
            f"the log-sum-exp: {blocks}"
        )
    return [
        " > kernels:",
        f"   attention: {attn}",
        f"   layers: {layers_line(plan)}",
        f"   cross entropy: {cross_entropy_line(plan)}",
        f"   optimizer: {optimizer_line(optimizer_config, plan)}",
        f"   recompute: {recompute_line(plan.config)}",
        *([f"   experts: {experts_line(plan)}"] if plan.moe_layers else []),
        f"   FP8: {fp8_line(plan, fp8_linears)}",
        f"   Triton: {triton_line(plan)}",
        "   Transformer Engine: not used (--transformer-impl local; no TE path is shipped)",
    ]


def _activation(plan: ExecutionPlan) -> str:
    config = plan.config
    if config.activation == "swiglu":
        return "SwiGLU"
    return {
        "tanh": "GELU (tanh approximation: Megatron-LM's bias-GELU; --no-bias-gelu-fusion for exact erf)",
        "none": "GELU (exact erf)",
    }[config.gelu_approximation]


def layers_line(plan: ExecutionPlan) -> str:
    """Compiled or eager layers, and the SwiGLU implementation."""
    act = _activation(plan)
    if plan.compile_layers:
        line = (
            f"torch.compile of each TransformerLayer (one shared graph): norms, RoPE, {act} and residual "
            "adds fused by Inductor"
        )
    else:
        norm = "rms_norm" if plan.config.normalization == "RMSNorm" else "layer_norm"
        line = f"eager (not compiled: {plan.compile_reason}); norms via F.{norm}, RoPE and {act} unfused"
    if plan.config.activation != "swiglu":
        return line
    if plan.swiglu == "triton":
        return line + "; SwiGLU backward: Triton kernel"
    if plan.device_type == "cuda":
        return (
            line + f"; SwiGLU backward: Inductor/ATen (Triton kernel swiglu: {plan.triton_reason('swiglu')})"
        )
    return line


def cross_entropy_line(plan: ExecutionPlan) -> str:
    """The output layer + loss path."""
    fused = "fused output layer + cross entropy, chunked over tokens (no full logits)"
    path = plan.cross_entropy
    if path == "fused_triton":
        return fused + ", loss/gradient pass one Triton kernel per chunk"
    why = plan.triton_reason("cross_entropy")
    if path == "fused_compiled":
        return fused + f", softmax/grad steps compiled (Triton kernel cross_entropy: {why})"
    if path == "fused_eager":
        return fused + (
            f", softmax/grad steps eager (Triton kernel cross_entropy: {why})"
            if plan.device_type == "cuda"
            else ""
        )
    if path == "vocab_parallel":
        return "vocab-parallel cross entropy over tp-sharded logits (fused path covers tp=1 only)"
    return "unfused (full fp32 logits): --no-cross-entropy-loss-fusion was given"


def triton_line(plan: ExecutionPlan) -> str:
    """Which Triton kernels passed their self-check on this device, and why the others do not run."""
    passed = [k for k, why in plan.triton_checks if why is None]
    reasons: dict[str, list[str]] = {}
    for k, why in plan.triton_checks:
        if why is not None:
            reasons.setdefault(why, []).append(k)
    parts = []
    if passed:
        parts.append(f"{', '.join(passed)} passed the self-check")
    if reasons:
        parts.append("not used: " + "; ".join(f"{', '.join(ks)} ({why})" for why, ks in reasons.items()))
    return "; ".join(parts) or "no kernels"


def experts_line(plan: ExecutionPlan) -> str:
    """How the MoE layers run: which layers, the routing, the dispatcher and the experts' GEMMs."""
    c = plan.config
    layers = sorted(plan.moe_layers)
    which = "every layer" if len(layers) == c.num_layers else f"layers {', '.join(map(str, layers))}"
    shared = (
        f", shared experts of {c.moe_shared_expert_intermediate_size}"
        if c.moe_shared_expert_intermediate_size
        else ""
    )
    gemm = (
        "one torch._grouped_mm per linear over the local experts where it runs (bf16 on Hopper; "
        "this torch's CPU op), else a loop over the experts"
        if c.moe_grouped_gemm
        else "a loop over the local experts (--moe-grouped-gemm for one grouped GEMM)"
    )
    return (
        f"{c.num_moe_experts} experts of {c.moe_ffn_hidden_size} in {which}, top-{c.moe_router_topk} "
        f"{c.moe_router_score_function} routing in {c.moe_router_dtype or 'fp32'}{shared}; "
        f"{c.moe_token_dispatcher_type} dispatcher over ep {c.expert_model_parallel_size} x etp "
        f"{c.expert_tensor_parallel_size}; {gemm}; "
        + (
            "routing, permutation and SwiGLU as compiled kernels, outside the layer's graph"
            if plan.compile_helpers
            else "eager"
        )
    )


def recompute_line(config: Any) -> str:
    """What activation recompute does, and when it will not pay."""
    g = getattr(config, "recompute_granularity", None)
    if g == "full":
        return (
            f"full, {config.recompute_method} over {config.recompute_num_layers} layer(s): layer inputs kept, "
            "each layer's forward replayed in backward"
        )
    if g == "selective":
        return (
            "selective (core attention only). The fused attention kernel keeps no [s, s] score matrix, so "
            "this saves little memory (docs/performance.md, recompute); "
            "--recompute-granularity full is what frees activation memory"
        )
    return "off (--recompute-granularity selective|full)"


def optimizer_line(optimizer_config: Any, plan: ExecutionPlan) -> str:
    """Which optimizer kernels the step uses (compiled where the plan compiles its helpers)."""
    cuda = plan.device_type == "cuda"
    if plan.compile_helpers:
        where = "compiled on CUDA"
    else:
        where = f"eager: not compiled, {plan.compile_reason}" if cuda else "eager on the CPU"
    fraction = getattr(optimizer_config, "optimizer_offload_fraction", 0.0)
    offload = (
        f"; {fraction:g} of the params' main copies and state in host memory, stepped on the CPU"
        if getattr(optimizer_config, "optimizer_cpu_offload", False) and fraction > 0
        else ""
    )
    if optimizer_config is None or (optimizer_config.optimizer == "adam" and optimizer_config.use_fused_adam):
        return (
            "AdamW, one pass per tensor: clipping, fp32 main param and moments, and the model-precision "
            f"copy ({where}); no host sync in the step{offload}"
        )
    kernel = "fused" if cuda and optimizer_config.use_fused_adam else "foreach"
    name = "SGD" if optimizer_config.optimizer == "sgd" else "AdamW"
    return f"torch.optim.{name} {kernel} over fp32 main params{offload}"


def fp8_line(plan: ExecutionPlan, fp8_linears: int | None = None) -> str:
    """Whether the tensor-parallel linears run in FP8, with which recipe, where, and who quantises
    (``fp8_linears``: how many FP8 GEMMs were built on this rank, None: not counted)."""
    config, fp8 = plan.config, plan.fp8
    gemms = str(config.params_dtype).replace("torch.", "")
    if fp8 is None:
        return f"off (no --fp8-format; GEMMs in {gemms})"
    recipe = fp8.recipe
    names = "/".join(_SHORT[n] for n in fp8.linears) or "no"
    count = f"{fp8_linears} " if fp8_linears is not None else ""
    where = f"{count}{names} linears of {len(fp8.layers)} of the {config.num_layers} transformer layers"
    if len(fp8.layers) < config.num_layers:
        where += (
            f" (the first {config.num_layers_at_start_in_bf16} and last {config.num_layers_at_end_in_bf16} "
            "transformer layers in bf16: --first-last-layers-bf16)"
        )
    if fp8.unaligned:
        where += f"; in bf16 (a weight dim not a multiple of 16): {', '.join(fp8.unaligned)}"
    kernels = plan.kernels
    if recipe.gemm_impl == "torchao":
        quant = "torchao's casts"
    elif kernels.uses("fp8_cast"):
        quant = "Triton cast-transpose kernels (one pass per tensor for the three GEMMs' layouts)"
    else:
        quant = f"torch code (Triton kernel fp8_cast: {plan.triton_reason('fp8_cast')})"
    if fp8.swiglu_block:
        how = (
            "Triton kernels"
            if kernels.uses("swiglu_fp8")
            else f"torch code (Triton kernel swiglu_fp8: {plan.triton_reason('swiglu_fp8')})"
        )
        quant += (
            f"; in the SwiGLU MLPs, SwiGLU's output and its gradient are quantised inside SwiGLU's own "
            f"passes by {how} (fc1 -> SwiGLU -> fc2 one FP8 block)"
        )
    if fp8.emulated:
        return (
            f"emulated on the CPU ({recipe.describe()}; MEGATRON_FP8_EMULATE=1, for tests only): fp32 GEMMs on "
            f"the dequantised fp8 values for {where}, quantised by {quant}"
        )
    return (
        f"on, {recipe.describe()}: {recipe.gemm_name} for {where}, quantised by {quant}; output layer, "
        f"embedding and attention in {gemms}. Its loss against bf16's and its speed: docs/performance.md"
    )
