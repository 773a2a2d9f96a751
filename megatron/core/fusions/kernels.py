"""The start-up report of which kernels a run uses, and why a faster one is not in use."""

from __future__ import annotations

import torch

_SDPA_NAMES = {0: "math (unfused)", 1: "flash", 2: "memory-efficient", 3: "cuDNN fused attention"}


def sdpa_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int,
                 causal: bool = True) -> str:
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


def kernel_report(config, device: torch.device, tp_size: int, compiled_layers: int, compile_reason: str,
                  fused_cross_entropy: bool, fp8_linears: int | None = None,
                  optimizer_config=None) -> list[str]:
    """Lines for the ``> kernels`` block printed at start-up; ``fp8_linears`` is what
    ``fusions.fp8.apply_fp8`` returned (None: not counted)."""
    dtype = config.params_dtype
    attn = sdpa_backend(device, dtype, config.num_attention_heads // tp_size,
                        max(1, config.num_query_groups // tp_size), config.kv_channels)
    if device.type != "cuda":
        attn += " (the CPU kernel of that name; cuDNN fused attention needs a CUDA device)"
    from megatron.core.fusions import triton_kernels
    from megatron.core.fusions.fp8 import fp8_emulated

    have_triton = device.type == "cuda" and triton_kernels.triton is not None
    act = "SwiGLU" if config.activation == "swiglu" else {
        "tanh": "GELU (tanh approximation: Megatron-LM's bias-GELU; --no-bias-gelu-fusion for exact erf)",
        "none": "GELU (exact erf)"}[config.gelu_approximation]
    if compiled_layers:
        layers = f"torch.compile of each TransformerLayer ({compiled_layers} layers, one shared graph): " \
                 f"norms, RoPE, {act} and residual adds fused by Inductor"
    else:
        layers = f"eager (not compiled: {compile_reason}); norms via F.{'rms_norm' if config.normalization == 'RMSNorm' else 'layer_norm'}, " \
                 f"RoPE and {act} unfused"
    if config.activation == "swiglu" and have_triton:
        layers += "; SwiGLU backward: Triton kernel"
    elif config.activation == "swiglu" and device.type == "cuda":
        layers += "; SwiGLU backward: Inductor/ATen (Triton not importable)"
    if fused_cross_entropy:
        ce = "fused output layer + cross entropy, chunked over tokens (no full logits)"
        if have_triton:
            ce += ", loss/gradient pass one Triton kernel per chunk"
        elif device.type == "cuda":
            ce += ", softmax/grad steps compiled (Triton not importable)"
    elif tp_size > 1:
        ce = "vocab-parallel cross entropy over tp-sharded logits (fused path covers tp=1 only)"
    else:
        ce = "unfused (full fp32 logits): --no-cross-entropy-loss-fusion was given"
    opt = optimizer_line(optimizer_config, device)
    return [
        " > kernels:",
        f"   attention: {attn}",
        f"   layers: {layers}",
        f"   cross entropy: {ce}",
        f"   optimizer: {opt}",
        f"   recompute: {recompute_line(config)}",
        f"   FP8: {fp8_line(config, dtype, fp8_linears, have_triton, emulated=fp8_emulated(device))}",
        "   Transformer Engine: not used (--transformer-impl local; no TE path is shipped)",
    ]


def recompute_line(config) -> str:
    """What activation recompute does, and when it will not pay."""
    g = getattr(config, "recompute_granularity", None)
    if g == "full":
        return (f"full, {config.recompute_method} over {config.recompute_num_layers} layer(s): layer inputs kept, "
                "each layer's forward replayed in backward")
    if g == "selective":
        return ("selective (core attention only). The fused attention kernel keeps no [s, s] score matrix, so "
                "this saves little memory (none measured on llama-3b, docs/performance.md); "
                "--recompute-granularity full is what frees activation memory")
    return "off (--recompute-granularity selective|full)"


def optimizer_line(optimizer_config, device: torch.device) -> str:
    """Which optimizer kernels the step uses."""
    where = "compiled on CUDA" if device.type == "cuda" else "eager on the CPU"
    if optimizer_config is None or (optimizer_config.optimizer == "adam" and optimizer_config.use_fused_adam):
        return ("AdamW, one pass per tensor: clipping, fp32 main param and moments, and the model-precision "
                f"copy ({where}); no host sync in the step")
    kernel = "fused" if device.type == "cuda" and optimizer_config.use_fused_adam else "foreach"
    return f"torch.optim.{'SGD' if optimizer_config.optimizer == 'sgd' else 'AdamW'} {kernel} over fp32 main params"


def fp8_line(config, dtype: torch.dtype, fp8_linears: int | None, have_triton: bool = True,
             emulated: bool = False) -> str:
    """Whether the tensor-parallel linears run in FP8, with which recipe, and who quantises
    (``emulated``: a CPU run under ``MEGATRON_FP8_EMULATE=1``, for tests)."""
    from megatron.core.fusions.fp8 import Fp8Recipe, swiglu_mlp_fusable

    recipe = Fp8Recipe.from_config(config)
    gemms = str(dtype).replace("torch.", "")
    if recipe is None:
        return f"off (no --fp8-format; GEMMs in {gemms})"
    where = "QKV, proj, fc1, fc2" if fp8_linears is None else f"{fp8_linears} QKV/proj/fc1/fc2 linears"
    if getattr(config, "first_last_layers_bf16", False):
        where += (f" (the first {config.num_layers_at_start_in_bf16} and last {config.num_layers_at_end_in_bf16} "
                  "transformer layers in bf16: --first-last-layers-bf16)")
    if emulated:
        return (f"emulated on the CPU ({recipe.describe()}; MEGATRON_FP8_EMULATE=1, for tests only): fp32 GEMMs on "
                f"the dequantised fp8 values for {where}")
    if recipe.gemm_impl == "torchao":
        quant = "torchao's casts"
    elif have_triton:
        quant = "Triton cast-transpose kernels (one pass per tensor for the three GEMMs' layouts)"
        if swiglu_mlp_fusable(config):
            quant += ("; in the SwiGLU MLPs, SwiGLU's output and its gradient are quantised inside SwiGLU's own "
                      "passes (fc1 -> SwiGLU -> fc2 one FP8 block)")
    else:
        quant = "torch code (Triton not importable: slower casts and transposes)"
    return (f"on, {recipe.describe()}: {recipe.gemm_name} for {where}, quantised by {quant}; output layer, "
            f"embedding and attention in {gemms}. Its loss against bf16's and its speed: docs/performance.md")
