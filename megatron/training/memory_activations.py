"""What autograd saves for backward, per transformer layer and at a stage's ends, on one rank.

The tensors this code's layers save (attention.py, mlp.py, norms.py, transformer_layer.py, the
fused cross entropy), counted once per storage; a view (q / k / v of the fused QKV output, the
attention output read by linear_proj) keeps its whole base alive. CUDA's kernels set the byte
widths (``Kernels``); a CPU plan gives the CPU's, so the counts can be checked against autograd's
saved tensors on this machine (tests/unit/test_memory_estimate.py).

With context parallelism over ``N`` ranks every activation runs along this rank's ``S / N`` tokens
(its two zigzag chunks), so every term below is counted for ``S / N`` tokens; the attention's own
saved tensors depend on the layer's comm type (:func:`cp_attention_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.execution_plan import ExecutionPlan, Fp8Plan, resolve
from megatron.core.fusions.fp8 import FP8_LINEAR_NAMES
from megatron.core.fusions.linear_cross_entropy import chunk_tokens
from megatron.core.fusions.triton import KERNELS
from megatron.core.transformer.context_parallel.layout import comm_type_of_layer
from megatron.core.transformer.moe_config_fields import moe_layer_pattern
from megatron.training.memory_params import StageParams


@dataclass(frozen=True)
class Kernels:
    """The implementation choices that change what a layer saves (from the run's execution plan).

    Attributes:
        swiglu_saves_output: the torch SwiGLU (autograd saves ``silu(gate)`` too); False: the Triton
            one or the FP8 block (only fc1's output).
        cross_entropy: ``ExecutionPlan.cross_entropy`` (``fused_*``: chunked, never the full logits).
        fp8: the plan's FP8 GEMMs (None: none).
        mask_bytes: bytes per element of a dropout mask (bool on CUDA; the input dtype on the CPU).
        stat_bytes: bytes per token of a norm statistic (fp32 on CUDA; the input dtype on the CPU).
        math_attention: SDPA runs its math backend (the probability matrix is saved).
    """

    swiglu_saves_output: bool = False
    cross_entropy: str = "fused_triton"
    fp8: Fp8Plan | None = None
    mask_bytes: int = 1
    stat_bytes: int = 4
    math_attention: bool = False

    @classmethod
    def from_plan(cls, plan: ExecutionPlan) -> Kernels:
        """What ``plan`` runs (a CPU plan: the CPU's mask and statistic dtypes)."""
        cpu = plan.device_type != "cuda"
        p = torch.tensor([], dtype=plan.config.params_dtype).element_size()
        return cls(
            swiglu_saves_output=plan.swiglu == "torch"
            and not (plan.fp8 is not None and plan.fp8.swiglu_block),
            cross_entropy=plan.cross_entropy,
            fp8=plan.fp8,
            mask_bytes=p if cpu else 1,
            stat_bytes=p if cpu else 4,
            math_attention="math" in plan.attention_kernel.lower(),
        )

    @classmethod
    def cuda(cls, model_config, tp: int) -> Kernels:
        """The CUDA path a GPU run of ``model_config`` takes when every Triton kernel passes its check."""
        plan = resolve(model_config, "meta", tp, triton_checks={k: None for k in KERNELS})
        fused = model_config.cross_entropy_loss_fusion and tp == 1
        return cls(cross_entropy="fused_triton" if fused else "vocab_parallel", fp8=plan.fp8)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes one micro-batch's activations are made of."""

    tokens: int  # s x b: what the linears see (gathered with sequence parallelism; s = S / cp)
    stream_tokens: int  # the residual stream's tokens on this rank (s x b / tp with sequence parallelism)
    hidden: int
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    rotary_dim: int
    ffn: int  # ffn hidden size on this rank
    gated: bool
    p: int  # bytes of the param / activation dtype
    seq: int  # this rank's tokens of a sequence (S / cp)
    batch: int
    cp: int = 1  # context-parallel ranks sharing one sequence


def cp_attention_bytes(shape: Shape, comm_type: str) -> float:
    """Bytes context-parallel attention saves beyond the q / k / v views the layer already holds:
    its output and fp32 log-sum-exp of this rank's queries, and with ``allgather`` the gathered keys
    and values of the whole sequence (``cp`` times the local ones); ``p2p`` saves only the local
    keys and values (the ring sends them again in backward)."""
    x = shape
    q, kv = x.heads * x.head_dim, x.kv_heads * x.head_dim
    total = x.tokens * q * x.p + x.tokens * x.heads * 4.0  # output, log-sum-exp
    if comm_type == "allgather":
        total += x.cp * x.tokens * 2 * kv * x.p
    return total


def activation_shape(cfg, micro_batch_size: int) -> Shape:
    m, tp = cfg.model, cfg.model.tensor_model_parallel_size
    cp = getattr(m, "context_parallel_size", 1) or 1
    s, b = cfg.training.seq_length // cp, micro_batch_size
    sp = m.sequence_parallel and tp > 1
    rope = m.position_embedding_type == "rope"
    return Shape(
        tokens=s * b,
        stream_tokens=s * b // tp if sp else s * b,
        hidden=m.hidden_size,
        heads=m.num_attention_heads // tp,
        kv_heads=max(1, m.num_query_groups // tp),
        head_dim=m.kv_channels,
        rotary_dim=m.rotary_dim if rope else 0,
        ffn=m.ffn_hidden_size // tp,
        gated=m.activation == "swiglu",
        p=dtype_bytes(m.params_dtype),
        seq=s,
        batch=b,
        cp=cp,
    )


def layer_activation_bytes(
    cfg, shape: Shape, kernels: Kernels, fp8_linears: tuple[str, ...] = (), layer_number: int = 1
) -> float:
    """Bytes autograd saves for backward in one transformer layer for one micro-batch, on one rank.

    ``layer_number``: the layer's global 1-based number (it picks the layer's cp comm type).

    ``fp8_linears``: the linears of this layer that run in FP8 (each saves its input at one byte per
    element, transposed, and its weight's FP8 copy, instead of the bf16 input).
    """
    m, x = cfg.model, shape
    t, ts, h, p = x.tokens, x.stream_tokens, x.hidden, x.p
    q, kv = x.heads * x.head_dim, x.kv_heads * x.head_dim
    norm_stats = 2 if m.normalization == "LayerNorm" else 1
    fp8 = set(fp8_linears)

    def linear_input(name: str, elements: float, also_saved: bool = False) -> float:
        """The input a linear saves: bf16 (unless another op saves the same tensor), or FP8's copy."""
        if name in fp8:
            return elements * 1.0  # the transposed e4m3 copy; a bf16 input saved elsewhere is counted there
        return 0.0 if also_saved else elements * p

    total = float(ts * h * p + ts * norm_stats * kernels.stat_bytes)  # input_layernorm: the layer input
    total += linear_input(
        "linear_qkv", t * h
    )  # the normed input (gathered over tp with sequence parallelism)
    total += t * (q + 2 * kv) * p  # qkv: held whole through the v (and, without RoPE, q / k) views
    if m.qk_layernorm:
        total += t * q * p + t * (x.heads + x.kv_heads) * norm_stats * kernels.stat_bytes
        if not x.rotary_dim:
            total += t * (q + kv) * p  # the normed q and k, saved by attention
    if x.rotary_dim:
        total += t * (q + kv) * p  # RoPE's outputs q and k, saved by attention
        total += 4 * t * x.rotary_dim * p  # cos / sin in the activation dtype, for q and for k
    modules = (m.recompute_modules or ["core_attn"]) if m.recompute_granularity == "selective" else []
    selective = "core_attn" in modules  # the core attention is recomputed
    if x.cp > 1 and not selective:
        comm = comm_type_of_layer(getattr(m, "cp_comm_type", None), layer_number, m.num_layers)
        total += cp_attention_bytes(x, comm)
    else:
        total += t * q * p  # attention's output (also linear_proj's input, a view of it)
    if not selective and x.cp == 1:
        total += t * x.heads * 4  # attention's fp32 log-sum-exp (recomputed with selective recompute)
    if kernels.math_attention and x.cp == 1:
        total += x.batch * x.heads * x.seq * x.seq * p * (1 if selective else 2 if m.attention_dropout else 1)
    total += linear_input("linear_proj", t * q, also_saved=True)
    dropout = m.hidden_dropout > 0
    total += 2 * ts * h * kernels.mask_bytes if dropout else 0.0  # the two residual-branch dropouts
    total += ts * h * p + ts * norm_stats * kernels.stat_bytes  # pre_mlp_layernorm: the mid residual
    if moe_layer_pattern(m)[layer_number - 1]:
        # --recompute-modules moe: the layer keeps only its input (the normed hidden) for the recompute
        return total + (t * h * p if "moe" in modules else moe_mlp_bytes(cfg, x, kernels))
    total += linear_input("linear_fc1", t * h)
    total += mlp_bytes(x, kernels, t, x.ffn)
    total += linear_input("linear_fc2", t * x.ffn)  # the activation's output
    return total


def mlp_bytes(x: Shape, kernels: Kernels, rows: float, ffn: int) -> float:
    """What an MLP of ``ffn`` channels (on this rank) saves between fc1 and fc2 for ``rows`` tokens:
    fc1's output, and silu(gate) where the SwiGLU kernel saves it."""
    total = rows * ffn * (2 if x.gated else 1) * x.p  # fc1's output, saved by the activation
    if x.gated and kernels.swiglu_saves_output:
        total += rows * ffn * x.p  # silu(gate), saved by the product
    return total


def moe_mlp_bytes(cfg, x: Shape, kernels: Kernels) -> float:
    """An MoE layer's saved tensors for one micro-batch on one rank: the normed input, the router's
    fp32 logits, scores and routing weights ``[T, E]``, the routed rows (each of the ``T`` tokens
    the linears see goes to k experts; balanced, a rank's local experts take ``T x k`` rows whatever
    ep) with their expert MLP of F_moe / etp and fc2's output (for the routing weights' gradient),
    and the shared experts' MLP of F_sh / tp on every token."""
    m, t, h, p = cfg.model, x.tokens, x.hidden, x.p
    rows = t * m.moe_router_topk
    total = t * h * p + 3 * t * m.num_moe_experts * 4.0  # normed input; logits, scores, weights
    ffn = m.moe_ffn_hidden_size // m.expert_tensor_parallel_size
    total += rows * h * p + mlp_bytes(x, kernels, rows, ffn) + rows * ffn * p + rows * h * p
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        total += mlp_bytes(x, kernels, t, shared // m.tensor_model_parallel_size)
        total += t * (shared // m.tensor_model_parallel_size) * p  # fc2's input
    return total


def fp8_weight_copy_bytes(cfg, info: StageParams, linears: tuple[str, ...]) -> float:
    """Bytes of the FP8 weight copies one FP8 layer saves per micro-batch (one byte per element)."""
    return float(sum(n for name, n in info.layer_linear_numels.items() if name in linears))


def layers_fp8(kernels: Kernels, first_layer: int, num_layers: int) -> list[tuple[str, ...]]:
    """The FP8 linears of each layer ``first_layer + 1 .. first_layer + num_layers`` (1-based global)."""
    fp8 = kernels.fp8
    if fp8 is None:
        return [()] * num_layers
    return [tuple(n for n in FP8_LINEAR_NAMES if fp8.runs(first_layer + i + 1, n)) for i in range(num_layers)]


@dataclass
class ChunkTerms:
    """What one model chunk (virtual stage) of a rank holds and saves."""

    activations: float  # saved per micro-batch, held from its forward to its backward
    recompute: float  # recomputed activations alive during one checkpointed group's backward
    forward_transient: float  # buffers alive only at the end of its forward (the logits of a chunk)
    backward_transient: float  # buffers alive at the start of its backward
    logits: float  # the output layer + loss's share of the above (last stage)
    grads_first: float  # gradient memory after its first backward of a step
    grads_more: float  # ... after later ones (accumulation into the buckets)


def chunk_activations(cfg, shape: Shape, kernels: Kernels, info: StageParams, chunk) -> tuple[float, float]:
    """(saved per micro-batch, recomputed during a checkpointed group's backward) of the chunk's layers."""
    m = cfg.model
    layers = [
        layer_activation_bytes(cfg, shape, kernels, fp8, chunk.offset + i + 1)
        + fp8_weight_copy_bytes(cfg, info, fp8)
        for i, fp8 in enumerate(layers_fp8(kernels, chunk.offset, chunk.num_layers))
    ]
    checkpoint_input = shape.stream_tokens * shape.hidden * shape.p
    n = len(layers)
    if m.recompute_granularity != "full" or n == 0:
        return sum(layers), 0.0
    k = m.recompute_num_layers or 1
    if m.recompute_method == "block":
        k = min(k, n)
        return k * checkpoint_input + sum(layers[k:]), max(layers[:k], default=0.0)
    groups = math.ceil(n / k)
    return groups * checkpoint_input, max(sum(layers[i : i + k]) for i in range(0, n, k))


def stage_end_activations(
    cfg, shape: Shape, kernels: Kernels, chunk, padded_vocab: int
) -> tuple[float, float, float, float]:
    """(saved, forward transient, backward transient, logits share) of the embedding (first stage),
    the final norm, the output layer and the loss (last stage), and RoPE's tables, per micro-batch."""
    m, x = cfg.model, shape
    t, ts, h, p = x.tokens, x.stream_tokens, x.hidden, x.p
    saved = fwd = bwd = logits = 0.0
    if x.rotary_dim and m.recompute_granularity == "full":
        saved += 2 * t * x.rotary_dim * 4  # fp32 cos / sin, arguments of every checkpointed group
    if chunk.pre_process:
        saved += t * 8 + (ts * h * kernels.mask_bytes if m.hidden_dropout > 0 else 0.0)  # ids, dropout mask
    if not chunk.post_process:
        return saved, fwd, bwd, logits
    norm_stats = 2 if m.normalization == "LayerNorm" else 1
    saved += ts * h * p + ts * norm_stats * kernels.stat_bytes  # the final norm's input
    vocab = padded_vocab // m.tensor_model_parallel_size
    if kernels.cross_entropy.startswith("fused"):
        c = chunk_tokens(t, vocab)
        grad_w = vocab * h * (p if c >= t else 4)  # one chunk: one GEMM in the param dtype
        held = t * h * p + grad_w + t * 8  # G_h, G_W, loss weights and losses (fp32)
        saved += held
        fwd = c * vocab * p  # one chunk's logits, overwritten by their gradient
        bwd = t * h * p + vocab * h * p  # the scaled G_h and G_W
        logits = held + fwd
    else:
        saved += t * h * p  # the output layer's input (gathered with sequence parallelism)
        softmax = t * vocab * 4.0  # fp32 softmax (log-probs at tp 1), saved for backward
        saved += softmax
        fwd = t * vocab * (p + 8.0)  # the logits, their fp32 copy and the shifted logits
        bwd = t * vocab * (4.0 + p)  # the fp32 gradient and its copy in the GEMM's dtype
        logits = softmax + fwd
    return saved, fwd, bwd, logits


def backward_working_set(shape: Shape) -> float:
    """Gradients of one layer's largest activations while its backward runs (two at once)."""
    x = shape
    widest = max(x.ffn * (2 if x.gated else 1), (x.heads + 2 * x.kv_heads) * x.head_dim, x.hidden)
    return 2.0 * x.tokens * widest * x.p
