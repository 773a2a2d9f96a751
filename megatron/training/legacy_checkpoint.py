"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints, read into this package's model.

    <load>/latest_checkpointed_iteration.txt          "1000", or "release"
    <load>/iter_0001000/  (release/ for "release")
      mp_rank_{tp:02d}/model_optim_rng.pt             pipeline size 1
      mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt    pipeline size > 1 (distrib_optim.pt beside it)

Each file is ``torch.save`` of one (tensor, pipeline) rank's dict: ``args`` (Megatron's
argparse.Namespace), ``checkpoint_version`` (3.0), ``iteration``, ``model`` (``model0``, ``model1``,
... per virtual stage), ``optimizer``, ``opt_param_scheduler``, ``rng_state`` and
``num_floating_point_operations_so_far``. ``model`` is the stage's plain ``state_dict``: layer
numbers count from 0 within each (pipeline rank, virtual stage), and every tensor is that tp rank's
shard: column-parallel weights (``linear_qkv``, ``linear_fc1``, ``output_layer``, the word
embedding) split on dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) on dim 1, the rest
replicated. The fused QKV is laid out per query group and SwiGLU's ``linear_fc1`` holds each rank's
own ``[gate; up]``, exactly as this package's layers are.

Key names come in three spellings, all mapped to ours: Megatron-Core's local spec (ours), its
Transformer Engine spec (norms fused into the next linear as ``layer_norm_weight``, plus
``_extra_state`` entries, which are dropped) and the legacy non-core model (nested
``language_model.encoder.layers.N...``). Loading merges the tp shards into global tensors,
renumbers the layers in virtual-stage order (stage v = chunk * pp + pipeline rank) and fills each
rank's slice of the current layout, so any saved tp/pp/vpp loads under any current one.

Not mapped: the optimizer state (Megatron orders it by its own param groups; the optimizer starts
from the loaded weights, as ``--no-load-optim`` would) and the RNG states (CUDA generators).
"""

from __future__ import annotations

import argparse
import os
import re
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointError, CheckpointReadError
from megatron.training.checkpoint_common import RESET_ON_FINETUNE, check_model_args, quiet, rank
from megatron.training.checkpoint_dirs import TRACKER_FILENAME, iteration_dir
from megatron.training.legacy_layout import collect_sources, fill, plan_fill, targets

FILENAME = "model_optim_rng.pt"
MIN_CHECKPOINT_VERSION = 2.0  # Megatron reorders the QKV of older files on load; we do not
_RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")
# Megatron-LM features that change what the weights mean: refused unless this build's shape check
# (``model_args_for_check``) compares the flag, i.e. implements it.
_UNSUPPORTED = (
    ("num_experts", "--num-experts"),
    ("multi_latent_attention", "--multi-latent-attention"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"),
    ("rotary_interleaved", "--rotary-interleaved"),
    ("use_rope_scaling", "--use-rope-scaling"),
    ("squared_relu", "--squared-relu"),
    ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
)


@dataclass
class LegacyCheckpoint:
    """An ``iter_XXXXXXX`` (or ``release``) directory holding ``mp_rank_*`` folders."""

    path: str
    iteration: int
    release: bool


def find_legacy_checkpoint(load_dir: str, ckpt_step: int | None = None) -> LegacyCheckpoint | None:
    """The legacy checkpoint ``--load`` / ``--ckpt-step`` name, or None when they name none (no
    tracker, or a directory in another format). The format is told by the files: Megatron's
    ``--auto-detect-ckpt-format`` behaviour, always on."""
    release = False
    if ckpt_step is not None:
        iteration = ckpt_step
    else:
        tracker = os.path.join(load_dir, TRACKER_FILENAME)
        if not os.path.isfile(tracker):
            return None
        with open(
            tracker, errors="replace"
        ) as f:  # bytes that are not text: the torch_dist reader names them
            text = f.read().strip()
        release = text == "release"
        if not release and not text.isdigit():
            return None  # the torch_dist reader names the bad tracker
        iteration = 0 if release else int(text)
    path = os.path.join(load_dir, "release") if release else iteration_dir(load_dir, iteration)
    if not os.path.isdir(path) or not any(_RANK_DIR.match(n) for n in os.listdir(path)):
        return None
    return LegacyCheckpoint(path, iteration, release)


# -------------------------------------------------------------------------------------------------
class Unpickled:
    """Stands in for a class a checkpoint pickles that this package does not import (Megatron's
    enums and configs, Transformer Engine's extra state, numpy's RNG arrays, ...). It records the
    arguments and state it was rebuilt with and runs no code of that class."""

    qualname = "?"
    args: tuple = ()
    state: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Unpickled:
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} (not loaded)>"


_REAL_CLASSES: dict[str, Any] = {
    "argparse.Namespace": argparse.Namespace,
    "types.SimpleNamespace": types.SimpleNamespace,
}


def _allow(name: str) -> tuple[Any, str]:
    """The class a checkpoint's global ``name`` unpickles as: itself if real, else a new stand-in."""
    if name in _REAL_CLASSES:
        return _REAL_CLASSES[name], name
    return type(name.rsplit(".", 1)[-1], (Unpickled,), {"qualname": name}), name


def read_rank_file(path: str) -> dict:
    """``torch.load(path, weights_only=True, mmap=True)``: tensors are mapped, not read, until used.

    The globals the file names beyond torch's own safe set are allowlisted for this load only:
    ``argparse.Namespace`` and ``types.SimpleNamespace`` as themselves, every other one as an
    inert :class:`Unpickled` record. torch still refuses the ``os``/``sys`` modules.

    Raises:
        CheckpointReadError: the file is missing, not a ``torch.save`` zip archive, or cannot be
            unpickled; CheckpointError: it holds something other than Megatron's checkpoint dict.
    """
    if not zipfile.is_zipfile(path):
        raise CheckpointReadError(
            f"{path} is missing or not a torch.save zip archive (saved by PyTorch < 1.6?)"
        )
    allowed: list[Any] = [_allow(n) for n in torch.serialization.get_unsafe_globals_in_checkpoint(path)]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # an unpickling error of a foreign file is the user's input, not our bug
        raise CheckpointReadError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not Megatron's checkpoint dict")
    return state


def _args_of(state: dict, path: str) -> dict:
    args = state.get("args")
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        return vars(args)
    if isinstance(args, dict):
        return args
    raise CheckpointError(
        f"{path} holds no readable 'args' (found {type(args).__name__}); it is not a checkpoint "
        "written by Megatron-LM's pretrain_gpt.py"
    )


# -------------------------------------------------------------------------------------------------
def _position_embedding(a: dict) -> str | None:
    if a.get("position_embedding_type") is not None:
        return a["position_embedding_type"]
    if a.get("use_rotary_position_embeddings"):
        return "rope"
    return "learned_absolute" if a.get("add_position_embedding", True) else "none"


def model_args(a: dict) -> dict:
    """Megatron-LM's saved args under the names ``loop_utils.model_args_for_check`` checks (its
    ``--disable-bias-linear`` is stored as ``add_bias_linear``; without ``--group-query-attention``
    the groups are the heads; ``--kv-channels`` defaults to hidden / heads)."""
    out = {
        k: a[k]
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "kv_channels",
            "ffn_hidden_size",
            "normalization",
            "swiglu",
            "qk_layernorm",
            "untie_embeddings_and_output_weights",
            "padded_vocab_size",
            "max_position_embeddings",
            "bias_gelu_fusion",
            "apply_layernorm_1p",
        )
        if a.get(k) is not None
    }
    if (
        a.get("layernorm_zero_centered_gamma") is not None
    ):  # where newer Megatron-LM stores --apply-layernorm-1p
        out["apply_layernorm_1p"] = bool(out.get("apply_layernorm_1p")) or bool(
            a["layernorm_zero_centered_gamma"]
        )
    heads = a.get("num_attention_heads")
    if heads and a.get("hidden_size") and "kv_channels" not in out:
        out["kv_channels"] = a["hidden_size"] // heads
    if heads:
        out["num_query_groups"] = a["num_query_groups"] if a.get("group_query_attention") else heads
    if "disable_bias_linear" in a:
        out["disable_bias_linear"] = bool(a["disable_bias_linear"])
    elif "add_bias_linear" in a:
        out["disable_bias_linear"] = not a["add_bias_linear"]
    out["position_embedding_type"] = _position_embedding(a)
    return out


def check_args(state: dict, path: str, model_args_check: dict | None, log: Callable[[str], None]) -> dict:
    """Refuse a checkpoint this package cannot represent; compare the shape flags. Returns the args."""
    a = _args_of(state, path)
    version = state.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < MIN_CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint_version {version!r}; only version {MIN_CHECKPOINT_VERSION} or "
            "newer is read (convert it with Megatron-LM's tools/checkpoint first)"
        )
    for name, flag in _UNSUPPORTED:
        if (
            flag not in (model_args_check or {})
            and a.get(name)
            and (name != "expert_model_parallel_size" or a[name] > 1)
        ):
            raise CheckpointError(
                f"{os.path.dirname(os.path.dirname(path))} was trained with {flag} {a[name]}, which "
                "this package does not implement; it cannot be loaded here"
            )
    if model_args_check:
        check_model_args(model_args(a), model_args_check, os.path.dirname(os.path.dirname(path)), log)
    return a


def rank_files(ckpt: LegacyCheckpoint, a: dict) -> dict[tuple[int, int], str]:
    """``{(tp, pp): file}`` for the saved layout (tensor / pipeline sizes from the args).

    Raises:
        CheckpointError: a rank's file is missing, or the directory holds folders of another layout.
    """
    tp, pp = int(a.get("tensor_model_parallel_size") or 1), int(a.get("pipeline_model_parallel_size") or 1)
    names = {
        (t, p): f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
    }
    present = {n for n in os.listdir(ckpt.path) if _RANK_DIR.match(n)}
    stray = sorted(present - set(names.values()))
    if stray:
        raise CheckpointError(
            f"{ckpt.path} holds {stray[0]}, which a tp {tp} x pp {pp} checkpoint (its args) does not "
            "write; expert-parallel checkpoints are not supported"
        )
    paths = {key: os.path.join(ckpt.path, name, FILENAME) for key, name in names.items()}
    missing = [path for path in paths.values() if not os.path.isfile(path)]
    if missing:
        raise CheckpointError(
            f"legacy checkpoint file {missing[0]} is missing (the checkpoint's args say tensor-parallel "
            f"size {tp}, pipeline size {pp}); copy the whole {os.path.basename(ckpt.path)} directory"
        )
    return paths


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -------------------------------------------------------------------------------------------------
def _first_file(ckpt: LegacyCheckpoint) -> str:
    for name in ("mp_rank_00", "mp_rank_00_000"):
        path = os.path.join(ckpt.path, name, FILENAME)
        if os.path.isfile(path):
            return path
    raise CheckpointError(
        f"legacy checkpoint file {os.path.join(ckpt.path, 'mp_rank_00', FILENAME)} (or mp_rank_00_000/) "
        "is missing; copy the whole directory the saving run wrote"
    )


def load_weights(
    ckpt: LegacyCheckpoint, first: tuple[str, dict], a: dict, model_sharded_state_dict: dict
) -> None:
    """Fill every tensor of ``model_sharded_state_dict`` (any current layout) from the files.

    Raises:
        CheckpointError: on every rank alike, listing tensors missing, unexpected or of another shape.
    """
    paths = rank_files(ckpt, a)
    states = {k: first[1] if p == first[0] else read_rank_file(p) for k, p in paths.items()}
    tied = not a.get("untie_embeddings_and_output_weights", False)
    sources, problems = collect_sources(states, paths, tied)
    wanted_targets = targets(model_sharded_state_dict)
    pairs, unfit = plan_fill(wanted_targets, sources, bool(a.get("swiglu")))
    wanted = set().union(*_gather({t.key for t in wanted_targets}))
    extra = [f"{k}: in the checkpoint but not in this model" for k in sorted(set(sources) - wanted)]
    found = sorted(set().union(*_gather(set(problems + unfit + extra))))
    if found:
        shown = "\n  ".join(found[:8]) + (f"\n  ... and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointError(
            f"legacy checkpoint {ckpt.path} does not fit this model:\n  {shown}\n"
            "check the model flags (--swiglu, --disable-bias-linear, --qk-layernorm, ...) against the "
            "saving run's"
        )
    fill(pairs)


def load_legacy_checkpoint(
    ckpt: LegacyCheckpoint,
    model_sharded_state_dict: dict,
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    model_args_check: dict[str, Any] | None = None,
    fp8_state: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Collectively load a legacy checkpoint into ``model_sharded_state_dict`` (``checkpointing.
    load_checkpoint``'s arguments and return value). The optimizer is not read: it restarts from the
    loaded weights (``reload_model_params``), as with ``--no-load-optim``; the LR/WD schedule is
    restored unless ``load_optim`` is False or ``finetune``; RNG states are not restored. A release
    checkpoint loads as with ``finetune``.

    Raises:
        CheckpointError: a missing or unreadable file, another model's shape flags, a feature this package
            lacks, tensors that do not fit, or no scheduler state when one is to be restored.
    """
    say = log if rank() == 0 else quiet
    finetune = finetune or ckpt.release
    say(
        f"loading legacy torch checkpoint (Megatron-LM's --ckpt-format torch) from {ckpt.path}"
        + (" (release: weights only, starting at iteration 0)" if ckpt.release else "")
    )
    first_path = _first_file(ckpt)
    first = read_rank_file(first_path)
    a = check_args(first, first_path, model_args_check, say)
    load_weights(ckpt, (first_path, first), a, model_sharded_state_dict)
    if optimizer is not None:
        if load_optim and not finetune:
            say(
                "  optimizer state: not read from a legacy checkpoint (Megatron orders it by its own parameter "
                "groups); the optimizer starts from the loaded weights, as with --no-load-optim"
            )
        optimizer.reload_model_params()
    if opt_param_scheduler is not None and load_optim and not finetune:
        sched = first.get("opt_param_scheduler", first.get("lr_scheduler"))
        if not isinstance(sched, dict):
            raise CheckpointError(
                f"{first_path} holds no LR-scheduler state (saved with --no-save-optim); resume with "
                "--no-load-optim or --finetune"
            )
        opt_param_scheduler.load_state_dict(dict(sched))
    if load_rng and not finetune:
        say(
            "  RNG states: not restored from a legacy checkpoint (CUDA generator states); dropout masks differ "
            "from the saving run's"
        )
    if fp8_state and not finetune:
        say("  FP8 amax histories: not in a legacy checkpoint; they restart with the first step")
    extra = {
        "iteration": int(first.get("iteration", first.get("total_iters", ckpt.iteration))),
        "consumed_train_samples": int(a.get("consumed_train_samples") or 0),
        "consumed_valid_samples": int(a.get("consumed_valid_samples") or 0),
        "num_floating_point_operations_so_far": int(first.get("num_floating_point_operations_so_far") or 0),
        "args": model_args(a),
        "checkpoint_version": first.get("checkpoint_version"),
    }
    if finetune:
        extra.update({k: 0 for k in RESET_ON_FINETUNE})
    say(f"  successfully loaded checkpoint from {ckpt.path} at iteration {extra['iteration']}")
    return extra
