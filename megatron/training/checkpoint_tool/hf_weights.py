"""The tensors of a Hugging Face family against ours: which of our checkpoint keys become which HF
names, and the reshaping between them, in both directions.

Our layout (``megatron.core.transformer``): the fused QKV weight stacks, per query group, the group's
``n_h / n_g`` query heads, then its key head, then its value head (``d`` rows each); SwiGLU's fc1 is
``[gate; up]``, stored as ``[2, F, h]``; norms are ``input_layernorm`` / ``pre_mlp_layernorm`` /
``decoder.final_layernorm``; the word embedding (and an untied output layer) has the padded
vocabulary's rows. HF splits q, k, v (Llama family) or concatenates them as ``[q | k | v]`` along the
output (GPT-2, whose ``Conv1D`` weights are stored ``[in, out]``, the transpose of ours).

Experts (``mlp.experts.linear_fc1.weight`` ``[E, 2F, h]``, each expert's ``[gate; up]``, stored
``[E, 2, F, h]``, and ``linear_fc2.weight`` ``[E, h, F]``; dim 0 the global expert index) are one piece
per layer with one HF tensor per expert (``experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj``,
Mixtral's ``w1`` / ``w3`` / ``w2``: the per-expert names of the released checkpoints, which every
transformers version reads).

Each :class:`Piece` converts a few tensors that belong together (one QKV weight and its three HF
tensors), so a conversion reads each of our tensors once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.training.checkpoint_tool.hf_moe import moe_ffn, moe_layer_pattern

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """Our tensors ``ours`` <-> HF tensors ``theirs`` (names in matching order of the lists the two
    functions take and return)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_hf: Callable[[Tensors], Tensors]
    to_ours: Callable[[Tensors], Tensors]


def _same(t: Tensors) -> Tensors:
    return list(t)


def _one(ours: str, theirs: str, to_hf=_same, to_ours=_same) -> Piece:
    return Piece((ours,), (theirs,), to_hf, to_ours)


@dataclass(frozen=True)
class Heads:
    """The attention's head counts: ``n_h`` query heads in ``n_g`` groups of ``d`` channels."""

    n_h: int
    n_g: int
    d: int

    def split(self, qkv: torch.Tensor) -> Tensors:
        """Our fused ``[n_g * (n_h/n_g + 2) * d, *rest]`` -> ``[q, k, v]`` (``[n_h * d, *rest]``, ...)."""
        per = self.n_h // self.n_g
        rest = qkv.shape[1:]
        g = qkv.reshape(self.n_g, per + 2, self.d, *rest)
        q = g[:, :per].reshape(self.n_h * self.d, *rest)
        k = g[:, per].reshape(self.n_g * self.d, *rest)
        v = g[:, per + 1].reshape(self.n_g * self.d, *rest)
        return [q.clone(), k.clone(), v.clone()]

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`."""
        per, rest = self.n_h // self.n_g, q.shape[1:]
        groups = (
            q.reshape(self.n_g, per, self.d, *rest),
            k.reshape(self.n_g, 1, self.d, *rest),
            v.reshape(self.n_g, 1, self.d, *rest),
        )
        return torch.cat(groups, dim=1).reshape(-1, *rest)


def _vocab_rows(vocab: int, padded: int) -> tuple[Callable, Callable]:
    """Export keeps the first ``vocab`` rows; import pads with zero rows to ``padded``."""

    def to_hf(t: Tensors) -> Tensors:
        return [t[0][:vocab].clone()]

    def to_ours(t: Tensors) -> Tensors:
        pad = t[0].new_zeros((padded - t[0].shape[0], *t[0].shape[1:]))
        return [torch.cat((t[0], pad))]

    return to_hf, to_ours


def _norm_to_hf(one_p: bool) -> Callable[[Tensors], Tensors]:
    """Our stored norm weight -> the weight the norm multiplies by (``1 + w`` with --apply-layernorm-1p)."""
    return (lambda t: [t[0] + 1]) if one_p else _same


def _swiglu_fc1(ffn: int, trailing: tuple[int, ...]) -> tuple[Callable, Callable]:
    """fc1 ``[gate; up]`` (``[2F, *trailing]``, stored ``[2, F, *trailing]``) <-> gate, up."""

    def to_hf(t: Tensors) -> Tensors:
        gate_up = t[0].reshape(2, ffn, *trailing)
        return [gate_up[0].clone(), gate_up[1].clone()]

    def to_ours(t: Tensors) -> Tensors:
        return [torch.stack((t[0], t[1]))]

    return to_hf, to_ours


def _dense_mlp(m: dict[str, Any], ours: str, mlp: str, ffn: int) -> list[Piece]:
    """A SwiGLU MLP of ``ffn`` channels: ours under ``ours`` (``linear_fc1``, ``linear_fc2``), HF's under
    ``mlp`` (``gate_proj``, ``up_proj``, ``down_proj``)."""
    pieces = []
    for kind in ("weight", "bias") if m["add_bias_linear"] else ("weight",):
        fc1_hf, fc1_ours = _swiglu_fc1(ffn, (m["hidden_size"],) if kind == "weight" else ())
        pieces.append(
            Piece(
                (f"{ours}linear_fc1.{kind}",),
                (f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"),
                fc1_hf,
                fc1_ours,
            )
        )
        pieces.append(_one(f"{ours}linear_fc2.{kind}", f"{mlp}down_proj.{kind}"))
    return pieces


def _experts(num_experts: int, ffn: int, h: int) -> tuple[Callable, Callable, Callable, Callable]:
    """(fc1 to HF, fc1 to ours, fc2 to HF, fc2 to ours) of ``num_experts`` SwiGLU experts: our fc1
    ``[E, 2F, h]`` (saved ``[E, 2, F, h]`` or ``[E, 2F, h]``) <-> E gates then E ups ``[F, h]``; our fc2
    ``[E, h, F]`` <-> E downs ``[h, F]``."""

    def fc1_to_hf(t: Tensors) -> Tensors:
        gate_up = t[0].reshape(num_experts, 2, ffn, h)
        return [gate_up[j, 0].clone() for j in range(num_experts)] + [
            gate_up[j, 1].clone() for j in range(num_experts)
        ]

    def fc1_to_ours(t: Tensors) -> Tensors:
        gates, ups = t[:num_experts], t[num_experts:]
        return [torch.stack([torch.cat((g, u)) for g, u in zip(gates, ups)])]

    def fc2_to_hf(t: Tensors) -> Tensors:
        down = t[0].reshape(num_experts, h, ffn)
        return [down[j].clone() for j in range(num_experts)]

    def fc2_to_ours(t: Tensors) -> Tensors:
        return [torch.stack(t)]

    return fc1_to_hf, fc1_to_ours, fc2_to_hf, fc2_to_ours


def _fused_experts(num_experts: int, ffn: int, h: int) -> tuple[Callable, Callable]:
    """fc1 to HF, fc1 to ours for transformers 5's fused ``experts.gate_up_proj`` ``[E, 2F, h]``
    (rows ``[gate; up]`` per expert: ours, whatever shape the checkpoint saved)."""

    def fc1_to_hf(t: Tensors) -> Tensors:
        return [t[0].reshape(num_experts, 2 * ffn, h).clone()]

    return fc1_to_hf, _same


def _moe_mlp(family: str, m: dict[str, Any], ours: str, hf: str, fused: bool = False) -> list[Piece]:
    """One layer's router, experts and shared expert: ours under ``ours`` (``decoder.layers.{i}.``),
    HF's under ``hf`` (``model.layers.{i}.``); ``fused``: the experts as transformers 5 holds them in
    memory (``mlp.experts.gate_up_proj`` / ``down_proj``, what ``save_pretrained(...,
    save_original_format=False)`` writes), else one tensor per expert."""
    num_experts, ffn = m["num_moe_experts"], moe_ffn(m)
    block = hf + ("block_sparse_moe." if family == "mixtral" and not fused else "mlp.")
    fc1_hf, fc1_ours, fc2_hf, fc2_ours = _experts(num_experts, ffn, m["hidden_size"])
    if fused:
        fc1_hf, fc1_ours = _fused_experts(num_experts, ffn, m["hidden_size"])
        experts = [
            Piece(
                (ours + "mlp.experts.linear_fc1.weight",), (block + "experts.gate_up_proj",), fc1_hf, fc1_ours
            ),
            _one(ours + "mlp.experts.linear_fc2.weight", block + "experts.down_proj"),
        ]
    else:
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        gate, up, down = ([f"{block}experts.{j}.{n}.weight" for j in range(num_experts)] for n in names)
        experts = [
            Piece((ours + "mlp.experts.linear_fc1.weight",), (*gate, *up), fc1_hf, fc1_ours),
            Piece((ours + "mlp.experts.linear_fc2.weight",), tuple(down), fc2_hf, fc2_ours),
        ]
    pieces = [_one(ours + "mlp.router.weight", block + "gate.weight"), *experts]
    shared = m.get("moe_shared_expert_intermediate_size")
    if shared:
        pieces += _dense_mlp(m, ours + "mlp.shared_experts.", block + "shared_expert.", shared)
        if m.get("moe_shared_expert_gate"):
            pieces.append(_one(ours + "mlp.shared_experts.gate_weight", block + "shared_expert_gate.weight"))
    return pieces


def llama_pieces(
    m: dict[str, Any], num_layers: int, vocab: int, padded: int, family: str = "llama", fused: bool = False
) -> list[Piece]:
    """Llama / Mistral / Qwen2 and the MoE families (``model.*``, ``lm_head.weight``), for our model
    fields ``m`` (``fused``: see ``_moe_mlp``)."""
    heads = Heads(m["num_attention_heads"], m["num_query_groups"], m["kv_channels"])
    emb_hf, emb_ours = _vocab_rows(vocab, padded)
    norm = _norm_to_hf(bool(m.get("apply_layernorm_1p")))
    pieces = [_one("embedding.word_embeddings.weight", "model.embed_tokens.weight", emb_hf, emb_ours)]
    qkv_bias = bool(m["add_bias_linear"] or m["add_qkv_bias"])
    has_experts = moe_layer_pattern(m)
    for i in range(num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        pieces.append(_one(ours + "input_layernorm.weight", hf + "input_layernorm.weight", norm))
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            pieces.append(
                Piece(
                    (f"{ours}self_attention.linear_qkv.{kind}",),
                    tuple(f"{attn}{p}_proj.{kind}" for p in "qkv"),
                    lambda t: heads.split(t[0]),
                    lambda t: [heads.fuse(*t)],
                )
            )
        pieces.append(_one(ours + "self_attention.linear_proj.weight", attn + "o_proj.weight"))
        if m.get("qk_layernorm"):
            for p in "qk":
                pieces.append(
                    _one(f"{ours}self_attention.{p}_layernorm.weight", f"{attn}{p}_norm.weight", norm)
                )
        pieces.append(_one(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", norm))
        if has_experts[i]:
            pieces += _moe_mlp(family, m, ours, hf, fused)
        else:
            pieces += _dense_mlp(m, ours + "mlp.", mlp, m["ffn_hidden_size"])
        if m["add_bias_linear"]:
            pieces.append(_one(ours + "self_attention.linear_proj.bias", attn + "o_proj.bias"))
    pieces.append(_one("decoder.final_layernorm.weight", "model.norm.weight", norm))
    if not m["share_embeddings_and_output_weights"]:
        pieces.append(_one("output_layer.weight", "lm_head.weight", emb_hf, emb_ours))
    return pieces


def _transposed(t: Tensors) -> Tensors:
    return [t[0].t().contiguous()]


def gpt2_pieces(m: dict[str, Any], num_layers: int, vocab: int, padded: int) -> list[Piece]:
    """GPT-2 (``transformer.*``, ``lm_head.weight``), for our model fields ``m``."""
    heads = Heads(m["num_attention_heads"], m["num_query_groups"], m["kv_channels"])
    emb_hf, emb_ours = _vocab_rows(vocab, padded)
    one_p = bool(m.get("apply_layernorm_1p"))
    pieces = [
        _one("embedding.word_embeddings.weight", "transformer.wte.weight", emb_hf, emb_ours),
        _one("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ]

    def norm(ours: str, hf: str) -> list[Piece]:
        return [
            _one(ours + ".weight", hf + ".weight", _norm_to_hf(one_p)),
            _one(ours + ".bias", hf + ".bias"),
        ]

    def c_attn_weight_hf(t: Tensors) -> Tensors:
        return [torch.cat(heads.split(t[0])).t().contiguous()]

    def c_attn_weight_ours(t: Tensors) -> Tensors:
        return [heads.fuse(*t[0].t().split(m["hidden_size"]))]

    def c_attn_bias_ours(t: Tensors) -> Tensors:
        return [heads.fuse(*t[0].split(m["hidden_size"]))]

    for i in range(num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        pieces += norm(ours + "input_layernorm", hf + "ln_1")
        qkv = ours + "self_attention.linear_qkv."
        pieces.append(_one(qkv + "weight", hf + "attn.c_attn.weight", c_attn_weight_hf, c_attn_weight_ours))
        pieces.append(
            _one(
                qkv + "bias",
                hf + "attn.c_attn.bias",
                lambda t: [torch.cat(heads.split(t[0]))],
                c_attn_bias_ours,
            )
        )
        proj = ours + "self_attention.linear_proj."
        pieces.append(_one(proj + "weight", hf + "attn.c_proj.weight", _transposed, _transposed))
        pieces.append(_one(proj + "bias", hf + "attn.c_proj.bias"))
        pieces += norm(ours + "pre_mlp_layernorm", hf + "ln_2")
        for fc, name in (("linear_fc1", "c_fc"), ("linear_fc2", "c_proj")):
            pieces.append(_one(f"{ours}mlp.{fc}.weight", f"{hf}mlp.{name}.weight", _transposed, _transposed))
            pieces.append(_one(f"{ours}mlp.{fc}.bias", f"{hf}mlp.{name}.bias"))
    pieces += norm("decoder.final_layernorm", "transformer.ln_f")
    if not m["share_embeddings_and_output_weights"]:
        pieces.append(_one("output_layer.weight", "lm_head.weight", emb_hf, emb_ours))
    return pieces


def pieces_for(family: str, m: dict[str, Any], vocab: int, padded: int, fused: bool = False) -> list[Piece]:
    """Every tensor of the model ``m`` (our fields) as pieces of ``family``, in HF's order (``fused``:
    experts in transformers 5's fused tensors, see ``_moe_mlp``)."""
    if family == "gpt2":
        return gpt2_pieces(m, m["num_layers"], vocab, padded)
    return llama_pieces(m, m["num_layers"], vocab, padded, family, fused)
