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
                  fused_cross_entropy: bool) -> list[str]:
    """Lines for the ``> kernels`` block printed at start-up."""
    dtype = config.params_dtype
    attn = sdpa_backend(device, dtype, config.num_attention_heads // tp_size,
                        max(1, config.num_query_groups // tp_size), config.kv_channels)
    if device.type != "cuda":
        attn += " (CPU: flash/cuDNN kernels need a CUDA device)"
    if compiled_layers:
        layers = f"torch.compile of each TransformerLayer ({compiled_layers} layers, one shared graph): " \
                 f"norms, RoPE, {config.activation.upper()} and residual adds fused by Inductor"
    else:
        layers = f"eager (not compiled: {compile_reason}); norms via F.{'rms_norm' if config.normalization == 'RMSNorm' else 'layer_norm'}, " \
                 "RoPE and activations unfused"
    if fused_cross_entropy:
        ce = "fused output layer + cross entropy, chunked over tokens (no full logits)"
        if device.type == "cuda":
            ce += ", softmax/grad steps compiled"
    elif tp_size > 1:
        ce = "vocab-parallel cross entropy over tp-sharded logits (fused path covers tp=1 only)"
    else:
        ce = "unfused (full fp32 logits): --no-cross-entropy-loss-fusion was given"
    opt = "torch.optim.AdamW fused=True (multi-tensor, fp32 main params)" if device.type == "cuda" \
        else "torch.optim.AdamW foreach (CPU)"
    return [
        " > kernels:",
        f"   attention: {attn}",
        f"   layers: {layers}",
        f"   cross entropy: {ce}",
        f"   optimizer: {opt}",
        f"   FP8: off (--fp8-format is not implemented yet; GEMMs in {str(dtype).replace('torch.', '')})",
        "   Transformer Engine: not used (--transformer-impl local; no TE path is shipped)",
    ]
