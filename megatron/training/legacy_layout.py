"""How the tensors of a Megatron-LM ``torch`` checkpoint map onto this package's model.

Key names in three spellings (Megatron-Core's local spec, its Transformer Engine spec, the legacy
non-core model) are mapped to ours (``our_name``); each tensor-parallel shard is merged into the
global tensor by Megatron's split rule (``split_rule``, ``merge_shards``); stage-local layer numbers
are renumbered in virtual-stage order (``collect_sources``); and each target of the current layout
takes its block of the global tensor (``plan_fill``, ``fill``). See ``legacy_checkpoint`` for the
file layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from megatron.core.dist_checkpointing import CheckpointError, ShardedTensor

_LAYER = re.compile(r"^(?:decoder|language_model\.encoder)\.layers\.(\d+)\.(.+)$")

# Inside a layer: (source prefix, our prefix). TE spec first, then TE's op fuser, then the legacy model.
_LAYER_RENAMES = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
    ("mlp.0.", "pre_mlp_layernorm."),
    ("mlp.1.basic_ops.0.", "mlp.linear_fc1."),
    ("mlp.1.basic_ops.1.", "mlp.linear_fc1."),
    ("mlp.3.basic_ops.0.", "mlp.linear_fc2."),
    ("mlp.3.basic_ops.1.", "mlp.linear_fc2."),
    ("input_norm.", "input_layernorm."),
    ("post_attention_norm.", "pre_mlp_layernorm."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
)
_TOP_RENAMES = (
    ("language_model.embedding.", "embedding."),
    ("language_model.encoder.final_norm.", "decoder.final_layernorm."),
    ("language_model.encoder.final_layernorm.", "decoder.final_layernorm."),
    ("language_model.output_layer.", "output_layer."),
)


def our_name(key: str, tied: bool) -> tuple[int | None, str] | None:
    """``(stage-local layer index or None, our name within the layer or the model)`` of a saved key;
    None for keys that hold nothing of this model: TE's ``_extra_state``, old rotary ``inv_freq``
    buffers and the last stage's copy of a tied output weight (the first stage's embedding is read)."""
    if key.endswith(("._extra_state", ".inv_freq")) or key.startswith("word_embeddings_for_head."):
        return None
    m = _LAYER.match(key)
    if m:
        rest = "self_" + m.group(2) if m.group(2).startswith("attention.") else m.group(2)
        for src, ours in _LAYER_RENAMES:
            if rest.startswith(src):
                rest = ours + rest[len(src) :]
                break
        return int(m.group(1)), rest
    for src, ours in _TOP_RENAMES:
        if key.startswith(src):
            key = ours + key[len(src) :]
            break
    if tied and key == "output_layer.weight":
        return None
    return None, key


def split_rule(name: str, swiglu: bool) -> tuple[int | None, int]:
    """(tp split dim or None when replicated, stride) of one of our tensors, as Megatron shards it."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or name.endswith(
        ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
    ):
        return 0, 1
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return 0, 2 if swiglu else 1
    if name.endswith(("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")):
        return 1, 1
    return None, 1


def merge_shards(shards: list[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """The global tensor from the tp shards: concatenated along ``dim``; with ``stride`` sub-tensors
    per shard (SwiGLU's ``[gate_r; up_r]``) the r-th pieces of all shards are concatenated first."""
    if dim is None or len(shards) == 1:
        return shards[0]
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim) for j in range(stride)], dim)


def _chunks(state: dict, path: str) -> list[dict]:
    if "model" in state:
        return [state["model"]]
    n = sum(1 for k in state if re.fullmatch(r"model\d+", k))
    if n == 0:
        raise CheckpointError(f"{path} holds no 'model' state; it is not a training checkpoint")
    return [state[f"model{i}"] for i in range(n)]


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _layer_offsets(
    chunks: dict[tuple[int, int], list[dict]], pp: int, tied: bool, problems: list[str]
) -> dict[tuple[int, int], int]:
    """Global index of each (pipeline rank, virtual stage)'s first layer: layers run in virtual-stage
    order, stage v = chunk * pp + pipeline rank, each holding its own 0-based numbers."""
    counts = {}
    for p in range(pp):
        for c, chunk in enumerate(chunks[(0, p)]):
            local = {m[0] for k, _ in _flatten(chunk) if (m := our_name(k, tied)) and m[0] is not None}
            if local != set(range(len(local))):
                problems.append(
                    f"pipeline rank {p}, virtual stage {c}: layer numbers {sorted(local)} are not 0..n-1"
                )
            counts[(p, c)] = len(local)
    offsets, total = {}, 0
    for c in range(len(chunks[(0, 0)])):
        for p in range(pp):
            offsets[(p, c)] = total
            total += counts.get((p, c), 0)
    return offsets


def collect_sources(
    states: dict[tuple[int, int], dict], paths: dict[tuple[int, int], str], tied: bool
) -> tuple[dict[str, list[Any]], list[str]]:
    """``{our global name: [tensor of tp rank 0, 1, ...]}`` over every file, plus the problems found."""
    tp = 1 + max(t for t, _ in states)
    pp = 1 + max(p for _, p in states)
    chunks = {k: _chunks(s, paths[k]) for k, s in states.items()}
    problems: list[str] = []
    num_chunks = len(chunks[(0, 0)])
    if any(len(c) != num_chunks for c in chunks.values()):
        problems.append("the files hold different numbers of virtual stages (model0, model1, ...)")
    offsets = _layer_offsets(chunks, pp, tied, problems)
    sources: dict[str, list[Any]] = {}
    for (t, p), stage_chunks in chunks.items():
        for c, chunk in enumerate(stage_chunks[:num_chunks]):
            for key, value in _flatten(chunk):
                mapped = our_name(key, tied)
                if mapped is None:
                    continue
                layer, rest = mapped
                name = rest if layer is None else f"decoder.layers.{offsets[(p, c)] + layer}.{rest}"
                slot = sources.setdefault(name, [None] * tp)
                if slot[t] is not None or not isinstance(value, torch.Tensor):
                    problems.append(
                        f"{key} in {paths[(t, p)]}: "
                        + (
                            "a second copy"
                            if slot[t] is not None
                            else f"a {type(value).__name__}, not a tensor"
                        )
                    )
                else:
                    slot[t] = value
    return sources, problems


def targets(sharded: dict) -> list[ShardedTensor]:
    """The ShardedTensors of a model's sharded state dict, depth first."""
    out = []
    for value in sharded.values():
        if isinstance(value, dict):
            out.extend(targets(value))
        else:
            assert isinstance(value, ShardedTensor), f"model state holds a {type(value).__name__}"
            out.append(value)
    return out


def plan_fill(
    targets: list[ShardedTensor], sources: dict[str, list[Any]], swiglu: bool
) -> tuple[list[tuple[ShardedTensor, torch.Tensor]], list[str]]:
    """Each target with the global tensor it is a slice of (shaped like ``global_shape``), plus the
    targets that cannot be filled: absent from the checkpoint, or of another shape."""
    pairs, problems = [], []
    for st in targets:
        shards = sources.get(st.key)
        if shards is None or any(s is None for s in shards):
            where = "the checkpoint" if shards is None else f"tp rank {shards.index(None)}'s file"
            problems.append(f"{st.key}: not in {where}")
            continue
        full = merge_shards(shards, *split_rule(st.key, swiglu))
        shape = tuple(st.global_shape)
        flat = (
            (shape[0] * shape[1], *shape[2:]) if len(shape) == full.dim() + 1 else shape
        )  # [2, F, h] of SwiGLU
        if tuple(full.shape) != flat:
            problems.append(f"{st.key}: checkpoint shape {list(full.shape)} vs this model's {list(flat)}")
            continue
        pairs.append((st, full.reshape(shape)))
    return pairs, problems


@torch.no_grad()
def fill(pairs: list[tuple[ShardedTensor, torch.Tensor]]) -> None:
    """Copy each target's block of its global tensor into the target (a view of the parameter)."""
    for st, full in pairs:
        block = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))
        st.data.copy_(full[block])
