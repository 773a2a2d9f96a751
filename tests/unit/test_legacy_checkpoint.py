"""Megatron-LM's legacy --ckpt-format torch: files written as Megatron lays them out, read under other layouts.

``write_megatron_checkpoint`` is the oracle: from one of our single-process models it writes what
Megatron-LM's torch format holds for a (tp, pp, vpp) run: one ``mp_rank_*`` folder per (tensor,
pipeline) rank, each ``model_optim_rng.pt`` holding that rank's shard of its stage's ``state_dict``
with stage-local layer numbers, in the names of Megatron-Core's Transformer Engine spec, its local
spec, or the legacy (non-core) model, plus ``args`` (an argparse.Namespace holding a class this
package cannot import), optimizer, scheduler and RNG entries.
"""

from __future__ import annotations

import argparse
import enum
import io
import os
import re
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from megatron.core.dist_checkpointing import CheckpointError, CheckpointReadError
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import checkpointing
from megatron.training.config import CheckpointConfig
from megatron.training.loop_utils import model_args_for_check

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))
from harness import run_distributed  # noqa: E402

VOCAB, SEQ = 64, 16
SWIGLU_GQA = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    num_query_groups=2,
    share_embeddings_and_output_weights=False,
)
TE_RENAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
LEGACY_RENAMES = {
    "input_layernorm.": "input_norm.",
    "pre_mlp_layernorm.": "post_attention_norm.",
    "self_attention.linear_qkv.": "self_attention.query_key_value.",
    "self_attention.linear_proj.": "self_attention.dense.",
    "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
    "mlp.linear_fc2.": "mlp.dense_4h_to_h.",
}

# A class of the saving run that this package cannot import (Megatron's enums live in its own `megatron`).
_SAVER_ONLY = types.ModuleType("megatron_lm_saver_only")


class AttnBackend(enum.Enum):
    auto = 5


AttnBackend.__module__ = _SAVER_ONLY.__name__
_SAVER_ONLY.AttnBackend = AttnBackend  # type: ignore[attr-defined]


def config(num_layers=4, **kw) -> TransformerConfig:
    base = dict(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **kw})


def build(cfg, seed=7, **kw) -> GPTModel:
    return GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, seed=seed, **kw
    ).eval()


def shape_check(cfg) -> dict:
    return model_args_for_check(
        SimpleNamespace(model=cfg, training=SimpleNamespace(max_position_embeddings=SEQ)), VOCAB
    )


def megatron_args(cfg, tp=1, pp=1, vpp=1, **over) -> argparse.Namespace:
    """Megatron-LM's args as its validate_args leaves them (the names it saves)."""
    gqa = cfg.num_query_groups != cfg.num_attention_heads
    a = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=gqa,
        num_query_groups=cfg.num_query_groups if gqa else 1,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        swiglu=cfg.activation == "swiglu",
        add_bias_linear=cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm,
        position_embedding_type=cfg.position_embedding_type,
        padded_vocab_size=VOCAB,
        untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
        max_position_embeddings=SEQ,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        consumed_train_samples=40,
        consumed_valid_samples=8,
        bias_gelu_fusion=True,
        attention_backend=AttnBackend.auto,
    )
    return argparse.Namespace(**{**a, **over})


def _shard(name: str, t: torch.Tensor, tp: int, r: int, swiglu: bool) -> torch.Tensor:
    """Megatron's tp shard r: column-parallel on dim 0 (SwiGLU fc1: each of gate and up), row-parallel on 1."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or ".linear_qkv." in name:
        return t.chunk(tp, 0)[r].clone()
    if ".linear_fc1." in name:
        halves = t.chunk(2, 0) if swiglu else (t,)
        return torch.cat([h.chunk(tp, 0)[r] for h in halves]).clone()
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(tp, 1)[r].clone()
    return t.clone()


def _saved_name(rest: str, spec: str) -> str:
    for ours, theirs in (TE_RENAMES if spec == "te" else LEGACY_RENAMES if spec == "legacy" else {}).items():
        if rest.startswith(ours):
            return theirs + rest[len(ours) :]
    return rest


def _stage(full: dict, spec: str, layers: range, first: bool, last: bool, tp: int, r: int, a) -> dict:
    """The state_dict Megatron's model of one virtual stage returns on tp rank r (local layer numbers)."""
    out: dict = {}
    for name, t in full.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m and int(m.group(1)) in layers:
            out[f"decoder.layers.{int(m.group(1)) - layers.start}.{_saved_name(m.group(2), spec)}"] = _shard(
                name, t, tp, r, a.swiglu
            )
        elif (name.startswith("embedding.") and first) or (
            not m and not name.startswith("embedding.") and last
        ):
            out[name] = _shard(name, t, tp, r, a.swiglu)
    if spec == "te":
        for i in range(len(layers)):
            for mod in (
                "self_attention.linear_qkv",
                "self_attention.linear_proj",
                "self_attention.core_attention",
                "mlp.linear_fc1",
                "mlp.linear_fc2",
            ):
                out[f"decoder.layers.{i}.{mod}._extra_state"] = io.BytesIO(b"fp8 meta")
    tied_copy = last and not first and not a.untie_embeddings_and_output_weights
    if tied_copy:
        out["output_layer.weight"] = _shard(
            "output_layer.weight", full["embedding.word_embeddings.weight"], tp, r, False
        )
    return _nest_legacy(out, tied_copy) if spec == "legacy" else out


def _nest_legacy(flat: dict, tied_copy: bool) -> dict:
    """The legacy GPT model's nested state_dict_for_save_checkpoint."""
    lm: dict = {}
    for k, v in flat.items():
        if k.startswith("embedding."):
            part, _, leaf = k[len("embedding.") :].partition(".")
            lm.setdefault("embedding", {}).setdefault(part, {})[leaf] = v
        elif k.startswith("decoder."):
            lm.setdefault("encoder", {})[k[len("decoder.") :].replace("final_layernorm.", "final_norm.")] = v
        elif not tied_copy:
            lm.setdefault("output_layer", {})[k[len("output_layer.") :]] = v
    out = {"language_model": lm}
    if tied_copy:
        out["word_embeddings_for_head"] = {"weight": flat["output_layer.weight"]}
    return out


def write_megatron_checkpoint(
    root,
    model: GPTModel,
    a: argparse.Namespace,
    *,
    spec: str = "te",
    iteration: int = 10,
    layers: list[int] | None = None,
    scheduler: dict | None = None,
) -> str:
    """Write ``root`` as Megatron-LM's torch format would for ``a``'s tp/pp/vpp (``layers``: layer count of
    each virtual stage in stage order chunk * pp + rank; default an even split). Returns the iteration dir."""
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    vpp = a.virtual_pipeline_model_parallel_size or 1
    full = {k: v.detach() for k, v in model.state_dict().items()}
    layers = layers or [a.num_layers // (pp * vpp)] * (pp * vpp)
    starts = np.cumsum([0, *layers]).tolist()
    iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    sched = scheduler or {
        "max_lr": 3e-3,
        "min_lr": 3e-4,
        "lr_warmup_steps": 8,
        "lr_decay_steps": 80,
        "lr_decay_style": "cosine",
        "num_steps": 40,
        "start_wd": 0.01,
        "end_wd": 0.01,
        "wd_incr_style": "constant",
        "wd_incr_steps": 80,
    }
    sys.modules[_SAVER_ONLY.__name__] = _SAVER_ONLY
    try:
        for p in range(pp):
            for r in range(tp):
                chunks = []
                for c in range(vpp):
                    v = c * pp + p
                    chunks.append(
                        _stage(
                            full, spec, range(starts[v], starts[v + 1]), v == 0, v == pp * vpp - 1, tp, r, a
                        )
                    )
                state = {
                    "args": a,
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "optimizer": {
                        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": []}
                    },
                    "opt_param_scheduler": sched,
                    "num_floating_point_operations_so_far": 1e12,
                    "rng_state": [
                        {
                            "random_rng_state": (3, (1, 2), None),
                            "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(),
                        }
                    ],
                }
                state.update(
                    {"model": chunks[0]} if vpp == 1 else {f"model{c}": m for c, m in enumerate(chunks)}
                )
                folder = f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else "")
                os.makedirs(os.path.join(iter_dir, folder))
                torch.save(state, os.path.join(iter_dir, folder, "model_optim_rng.pt"))
    finally:
        del sys.modules[_SAVER_ONLY.__name__]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return iter_dir


class _Sched:
    def __init__(self) -> None:
        self.loaded: dict | None = None

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd


class _Optim:
    reloaded = False

    def reload_model_params(self) -> None:
        self.reloaded = True


def _load(root, sharded, cfg, **kw):
    lines: list[str] = []
    extra = checkpointing.load_checkpoint(
        str(root), sharded, model_args_check=shape_check(cfg), log=lines.append, **kw
    )
    return extra, "\n".join(lines)


def _assert_same_weights(model: GPTModel, ref: GPTModel) -> None:
    ref_sd = ref.state_dict()
    for name, t in model.state_dict().items():
        assert_close(t, ref_sd[model.global_param_name(name)], rtol=0, atol=0, msg=name)


# -------------------------------------------------------------------------------------------------
def test_te_spec_tp2_pp2_loads_into_one_process(tmp_path):
    cfg = config(**SWIGLU_GQA)
    ref = build(cfg, seed=1)
    write_megatron_checkpoint(tmp_path, ref, megatron_args(cfg, tp=2, pp=2), spec="te")
    model = build(cfg, seed=2)
    sched, optim = _Sched(), _Optim()
    extra, out = _load(tmp_path, model.sharded_state_dict(), cfg, optimizer=optim, opt_param_scheduler=sched)
    _assert_same_weights(model, ref)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert_close(model(ids, None, None), ref(ids, None, None), rtol=0, atol=0)
    assert (extra["iteration"], extra["consumed_train_samples"], extra["consumed_valid_samples"]) == (
        10,
        40,
        8,
    )
    assert extra["num_floating_point_operations_so_far"] == 10**12
    assert sched.loaded is not None and sched.loaded["num_steps"] == 40 and optim.reloaded
    assert (
        "legacy torch checkpoint" in out and "optimizer state: not read" in out and "RNG states: not" in out
    )


def test_local_spec_uneven_virtual_stages_load_into_two_pipeline_stages(tmp_path):
    """Saved pp2 x vpp2 with 1/2/1/0 layers per virtual stage; read as our pp2 stages of 3 + 1 layers, the
    last stage's tied output weight included."""
    cfg = config()
    ref = build(cfg, seed=1)
    write_megatron_checkpoint(
        tmp_path, ref, megatron_args(cfg, pp=2, vpp=2), spec="local", layers=[1, 2, 1, 0]
    )
    first = build(cfg, seed=2, post_process=False, num_layers=3)
    last = build(cfg, seed=3, pre_process=False, num_layers=1, layer_offset=3)
    _load(tmp_path, {"model0": first.sharded_state_dict(), "model1": last.sharded_state_dict()}, cfg)
    _assert_same_weights(first, ref)
    _assert_same_weights(last, ref)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert_close(
        last(None, None, None, decoder_input=first(ids, None, None)), ref(ids, None, None), rtol=0, atol=0
    )


def test_legacy_model_keys_tp2_pp2(tmp_path):
    cfg = config()
    ref = build(cfg, seed=1)
    write_megatron_checkpoint(tmp_path, ref, megatron_args(cfg, tp=2, pp=2), spec="legacy")
    model = build(cfg, seed=2)
    _load(tmp_path, model.sharded_state_dict(), cfg)
    _assert_same_weights(model, ref)


def _tp2_body(ps, root: str, ref_logits: torch.Tensor, ids: torch.Tensor) -> None:
    cfg = config(**SWIGLU_GQA)
    model = build(cfg, seed=2, parallel_state=ps, parallel_output=False)
    _load(root, model.sharded_state_dict(), cfg)
    assert_close(model(ids, None, None), ref_logits, rtol=1e-5, atol=1e-5)


def test_te_spec_tp1_pp2_loads_into_tp2(tmp_path):
    cfg = config(**SWIGLU_GQA)
    ref = build(cfg, seed=1)
    write_megatron_checkpoint(tmp_path, ref, megatron_args(cfg, pp=2), spec="te")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        logits = ref(ids, None, None)
    run_distributed(
        _tp2_body, world_size=2, tp=2, kwargs=dict(root=str(tmp_path), ref_logits=logits, ids=ids)
    )


# -------------------------------------------------------------------------------------------------
def test_shape_mismatch_names_the_flag(tmp_path):
    cfg = config()
    write_megatron_checkpoint(tmp_path, build(cfg), megatron_args(cfg, tp=2))
    other = config(hidden_size=64)
    with pytest.raises(CheckpointError, match="--hidden-size: checkpoint 32 vs current 64"):
        _load(tmp_path, build(other).sharded_state_dict(), other)


def test_missing_rank_file_names_it(tmp_path):
    cfg = config()
    iter_dir = write_megatron_checkpoint(tmp_path, build(cfg), megatron_args(cfg, tp=2, pp=2))
    os.remove(os.path.join(iter_dir, "mp_rank_01_001", "model_optim_rng.pt"))
    with pytest.raises(
        CheckpointError,
        match=r"mp_rank_01_001/model_optim_rng.pt is missing \(the checkpoint's args say "
        r"tensor-parallel size 2, pipeline size 2\)",
    ) as e:
        _load(tmp_path, build(cfg).sharded_state_dict(), cfg)
    assert "\n" not in str(e.value)


def test_tensors_that_do_not_fit_are_listed(tmp_path):
    """Args that agree but files that do not (qk norms the flags do not ask for) are refused, not dropped."""
    saved = config(qk_layernorm=True)
    write_megatron_checkpoint(tmp_path, build(saved), megatron_args(saved, qk_layernorm=False))
    cfg = config()
    with pytest.raises(
        CheckpointError,
        match="decoder.layers.0.self_attention.q_layernorm.weight: in the checkpoint but not in this model",
    ):
        _load(tmp_path, build(cfg).sharded_state_dict(), cfg)


def test_unsupported_feature_and_old_version_are_refused(tmp_path):
    cfg = config()
    write_megatron_checkpoint(tmp_path, build(cfg), megatron_args(cfg, rotary_interleaved=True))
    with pytest.raises(
        CheckpointError, match="trained with --rotary-interleaved True, which this package does not"
    ):
        _load(tmp_path, build(cfg).sharded_state_dict(), cfg)
    write_megatron_checkpoint(tmp_path / "old", build(cfg), megatron_args(cfg, attention_backend=None))
    path = tmp_path / "old" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    torch.save({**torch.load(path, weights_only=False), "checkpoint_version": 1.0}, path)
    with pytest.raises(
        CheckpointError, match="has checkpoint_version 1.0; only version 2.0 or newer is read"
    ):
        _load(tmp_path / "old", build(cfg).sharded_state_dict(), cfg)


def test_file_that_runs_code_on_load_is_refused(tmp_path):
    cfg = config()
    iter_dir = write_megatron_checkpoint(tmp_path, build(cfg), megatron_args(cfg))
    path = os.path.join(iter_dir, "mp_rank_00", "model_optim_rng.pt")

    class Evil:
        def __reduce__(self):
            return os.system, ("echo should-not-run",)

    torch.save({"args": megatron_args(cfg, attention_backend=None), "evil": Evil()}, path)
    with pytest.raises(CheckpointReadError, match="cannot read .*model_optim_rng.pt"):
        _load(tmp_path, build(cfg).sharded_state_dict(), cfg)


def test_release_loads_weights_only_at_iteration_zero(tmp_path):
    cfg = config()
    ref = build(cfg, seed=1)
    iter_dir = write_megatron_checkpoint(tmp_path, ref, megatron_args(cfg))
    os.rename(iter_dir, tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    model, sched = build(cfg, seed=2), _Sched()
    extra, out = _load(tmp_path, model.sharded_state_dict(), cfg, opt_param_scheduler=sched)
    _assert_same_weights(model, ref)
    assert extra["iteration"] == 0 and extra["consumed_train_samples"] == 0 and sched.loaded is None
    assert "release: weights only" in out


def test_torch_format_saves_are_refused():
    with pytest.raises(ValueError, match="saves are written as torch_dist only; drop --ckpt-format torch"):
        CheckpointConfig(save="ck", ckpt_format="torch")
    assert CheckpointConfig(load="ck", ckpt_format="torch").ckpt_format == "torch"
