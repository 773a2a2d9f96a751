"""checkpoint.py convert for the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): tiny
random Hugging Face models built here (2 layers, 4 experts, top-2, fp32; never downloaded). Their
configs map to our MoE fields and back, their weights to our expert tensors and back bit-exactly,
our routing fields compute the HF MoE block's output, HF -> ours -> HF keeps the logits (the tool's
check and an independent one), a GPTModel checkpoint saved under ep2 exports, and what a family
cannot express is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron.training.checkpoint_tool import hf_families, hf_weights  # noqa: E402
from megatron.training.checkpoint_tool.errors import ToolError  # noqa: E402

E, TOPK, H, F_MOE, F_SHARED, F_DENSE, VOCAB = 4, 2, 64, 48, 80, 96, 200
BASE = dict(
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    num_experts_per_tok=TOPK,
    router_aux_loss_coef=0.02,
)
FAMILY_KW = {
    "mixtral": dict(num_local_experts=E, intermediate_size=F_MOE, tie_word_embeddings=False),
    "qwen2_moe": dict(
        num_experts=E,
        moe_intermediate_size=F_MOE,
        shared_expert_intermediate_size=F_SHARED,
        intermediate_size=F_DENSE,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        num_experts=E,
        moe_intermediate_size=F_MOE,
        intermediate_size=F_DENSE,
        norm_topk_prob=True,
        head_dim=24,
        tie_word_embeddings=True,
    ),
}
CLASSES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}


def make_hf(family: str, **kw) -> torch.nn.Module:
    """A tiny random HF model of ``family``; every weight moved off its init (routers included, so
    that the routing depends on the tokens)."""
    torch.manual_seed(0)
    name = CLASSES[family]
    cfg = getattr(transformers, name + "Config")(**{**BASE, **FAMILY_KW[family], **kw})
    model = getattr(transformers, name + "ForCausalLM")(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.float().eval()


def saved_tensors(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes (the released checkpoints' per-expert names)."""
    model.save_pretrained(tmp_path / "hf")
    return load_file(tmp_path / "hf" / "model.safetensors")


def to_ours(family: str, fields: dict, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ours = {}
    for piece in hf_weights.pieces_for(family, fields, VOCAB, 256):
        ours.update(zip(piece.ours, piece.to_ours([hf[n] for n in piece.theirs])))
    return ours


def to_hf(family: str, fields: dict, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = {}
    for piece in hf_weights.pieces_for(family, fields, VOCAB, 256):
        hf.update(zip(piece.theirs, piece.to_hf([ours[k] for k in piece.ours])))
    return hf


@pytest.mark.parametrize("family", list(CLASSES))
def test_config_maps_to_our_fields_and_back(family):
    hf = make_hf(family)
    got, fields, max_pos = hf_families.fields_from_hf(hf.config)
    assert got == family and max_pos == 64
    assert fields["num_moe_experts"] == E and fields["moe_router_topk"] == TOPK
    assert fields["moe_ffn_hidden_size"] == F_MOE and fields["moe_layer_freq"] == 1
    assert fields["moe_router_score_function"] == "softmax" and fields["add_bias_linear"] is False
    assert fields["moe_aux_loss_coeff"] == 0.02
    # Mixtral and norm_topk_prob true renormalise the chosen weights: Megatron's default (softmax over
    # the top-k logits); norm_topk_prob false keeps the top-k of the full softmax (pre-softmax).
    assert fields["moe_router_pre_softmax"] is (family == "qwen2_moe")
    assert fields["qk_layernorm"] is (family == "qwen3_moe")
    assert fields["add_qkv_bias"] is (family == "qwen2_moe")
    shared = F_SHARED if family == "qwen2_moe" else None
    assert fields["moe_shared_expert_intermediate_size"] == shared
    assert fields["moe_shared_expert_gate"] is (family == "qwen2_moe")
    assert fields["kv_channels"] == (24 if family == "qwen3_moe" else H // 4)
    assert hf_families.detect_family(fields) == family
    hf_families.check_expressible(family, fields)

    written = hf_families.hf_config(family, fields, VOCAB, 64, "float32", None, None)
    assert written["architectures"] == [type(hf).__name__] and written["model_type"] == family
    again = getattr(transformers, CLASSES[family] + "Config")(**written)
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    keys += ["num_experts_per_tok", "router_aux_loss_coef", "intermediate_size", "tie_word_embeddings"]
    if family == "mixtral":
        keys += ["num_local_experts"]
    else:
        keys += ["num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"]
        keys += ["shared_expert_intermediate_size", "qkv_bias"] if family == "qwen2_moe" else ["head_dim"]
    for key in keys:
        assert getattr(again, key) == getattr(hf.config, key), key


@pytest.mark.parametrize("family", list(CLASSES))
def test_weights_map_to_our_expert_tensors_and_back_bit_exactly(family, tmp_path):
    hf = make_hf(family)
    _, fields, _ = hf_families.fields_from_hf(hf.config)
    disk = saved_tensors(hf, tmp_path)
    ours = to_ours(family, fields, disk)
    for i, layer in enumerate(hf.model.layers):
        p = f"decoder.layers.{i}.mlp."
        assert ours[p + "router.weight"].shape == (E, H)
        assert ours[p + "experts.linear_fc1.weight"].shape == (E, 2 * F_MOE, H)
        assert ours[p + "experts.linear_fc2.weight"].shape == (E, H, F_MOE)
        # Our stacked experts are transformers' fused ones ([E, 2F, h] rows [gate; up], [E, h, F]).
        assert torch.equal(ours[p + "experts.linear_fc1.weight"], layer.mlp.experts.gate_up_proj.detach())
        assert torch.equal(ours[p + "experts.linear_fc2.weight"], layer.mlp.experts.down_proj.detach())
        assert torch.equal(ours[p + "router.weight"], layer.mlp.gate.weight.detach())
        if family == "qwen2_moe":
            shared = layer.mlp.shared_expert
            fc1 = torch.cat((shared.gate_proj.weight, shared.up_proj.weight)).detach()
            assert torch.equal(ours[p + "shared_experts.linear_fc1.weight"].reshape(2 * F_SHARED, H), fc1)
            assert torch.equal(ours[p + "shared_experts.linear_fc2.weight"], shared.down_proj.weight.detach())
            assert ours[p + "shared_experts.gate_weight"].shape == (1, H)
        if family == "qwen3_moe":
            q_norm = layer.self_attn.q_norm.weight.detach()
            assert torch.equal(ours[f"decoder.layers.{i}.self_attention.q_layernorm.weight"], q_norm)
    back = to_hf(family, fields, ours)
    assert sorted(back) == sorted(disk)
    for key, value in disk.items():
        assert torch.equal(back[key], value), key
    # The checkpoint may hold fc1 as [E, 2, F, h] (the SwiGLU halves apart): the same HF tensors.
    split = {
        k: v.reshape(E, 2, F_MOE, H) if k.endswith(".mlp.experts.linear_fc1.weight") else v
        for k, v in ours.items()
    }
    assert all(torch.equal(to_hf(family, fields, split)[k], v) for k, v in disk.items())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_5_fused_experts_read_as_the_per_expert_files(family, tmp_path):
    """A directory saved with save_original_format=False holds transformers 5's fused experts
    (mlp.experts.gate_up_proj / down_proj, Mixtral's under mlp.): the import reads the same tensors."""
    hf = make_hf(family)
    _, fields, _ = hf_families.fields_from_hf(hf.config)
    per_expert = to_ours(family, fields, saved_tensors(hf, tmp_path))
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused_files = load_file(tmp_path / "fused" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused_files
    fused, back = {}, {}
    for piece in hf_weights.pieces_for(family, fields, VOCAB, 256, fused=True):
        converted = piece.to_ours([fused_files[n] for n in piece.theirs])
        fused.update(zip(piece.ours, converted))
        back.update(zip(piece.theirs, piece.to_hf(converted)))
    assert sorted(back) == sorted(fused_files)
    assert all(torch.equal(back[k], v) for k, v in fused_files.items())
    assert sorted(fused) == sorted(per_expert)
    assert all(torch.equal(fused[k].reshape(v.shape), v) for k, v in per_expert.items())


def _megatron_moe_block(
    x: torch.Tensor, fields: dict, w: dict[str, torch.Tensor], prefix: str
) -> torch.Tensor:
    """Megatron's MoE layer on tokens ``x`` [T, h] from our tensors: its routing rule for our fields
    (softmax score function; top-k of the logits then softmax, or with --moe-router-pre-softmax the
    top-k of the softmax), SwiGLU experts, the shared expert with its sigmoid gate."""
    logits = x @ w[prefix + "router.weight"].t()  # [T, E]
    if fields["moe_router_pre_softmax"]:
        probs, chosen = torch.topk(torch.softmax(logits, dim=-1), fields["moe_router_topk"], dim=-1)
    else:
        top, chosen = torch.topk(logits, fields["moe_router_topk"], dim=-1)
        probs = torch.softmax(top, dim=-1)
    fc1, fc2 = w[prefix + "experts.linear_fc1.weight"], w[prefix + "experts.linear_fc2.weight"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(chosen.shape[1]):
            gate, up = (fc1[chosen[t, k]] @ x[t]).chunk(2)
            out[t] += probs[t, k] * (fc2[chosen[t, k]] @ (torch.nn.functional.silu(gate) * up))
    if fields["moe_shared_expert_intermediate_size"]:
        gate, up = (w[prefix + "shared_experts.linear_fc1.weight"].reshape(-1, x.shape[1]) @ x.t()).chunk(2)
        shared = (w[prefix + "shared_experts.linear_fc2.weight"] @ (torch.nn.functional.silu(gate) * up)).t()
        out += torch.sigmoid(x @ w[prefix + "shared_experts.gate_weight"].t()) * shared
    return out


@pytest.mark.parametrize("family", list(CLASSES))
def test_our_routing_fields_compute_the_hf_moe_block(family, tmp_path):
    """The routing equivalences the import relies on, checked on the MoE block alone."""
    hf = make_hf(family)
    _, fields, _ = hf_families.fields_from_hf(hf.config)
    ours = to_ours(family, fields, saved_tensors(hf, tmp_path))
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf.model.layers[1].mlp(x[None])[0]
        got = _megatron_moe_block(x, fields, ours, "decoder.layers.1.mlp.")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The other routing rule gives other outputs: the comparison tells them apart.
        other = {**fields, "moe_router_pre_softmax": not fields["moe_router_pre_softmax"]}
        assert (_megatron_moe_block(x, other, ours, "decoder.layers.1.mlp.") - want).abs().max() > 1e-3


def test_qwen_dense_layers_are_a_layer_pattern(tmp_path):
    """mlp_only_layers / decoder_sparse_step become --moe-layer-freq as a per-layer list (Megatron counts
    an int frequency from layer 0, HF's step from layer step - 1); dense layers keep intermediate_size."""
    hf = make_hf("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    _, fields, _ = hf_families.fields_from_hf(hf.config)
    assert fields["moe_layer_freq"] == [0, 1, 0, 0] and fields["ffn_hidden_size"] == F_DENSE
    disk = saved_tensors(hf, tmp_path)
    ours = to_ours("qwen3_moe", fields, disk)
    assert ours["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2, F_DENSE, H)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight" in ours
    assert "decoder.layers.2.mlp.router.weight" not in ours
    back = to_hf("qwen3_moe", fields, ours)
    assert sorted(back) == sorted(disk) and all(torch.equal(back[k], v) for k, v in disk.items())
    written = hf_families.hf_config("qwen3_moe", fields, VOCAB, 64, "float32", None, None)
    assert written["mlp_only_layers"] == [0, 2, 3] and written["decoder_sparse_step"] == 1
    again = transformers.Qwen3MoeConfig(**written)
    assert [type(layer.mlp).__name__ for layer in transformers.Qwen3MoeForCausalLM(again).model.layers] == [
        type(layer.mlp).__name__ for layer in hf.model.layers
    ]


def test_experts_default_to_the_ffn_hidden_size(tmp_path):
    """A trained checkpoint without --moe-ffn-hidden-size has experts of --ffn-hidden-size."""
    hf = make_hf("mixtral")
    _, fields, _ = hf_families.fields_from_hf(hf.config)
    fields = {**fields, "moe_ffn_hidden_size": None, "ffn_hidden_size": F_MOE}
    assert (
        hf_families.hf_config("mixtral", fields, VOCAB, 64, "float32", None, None)["intermediate_size"]
        == F_MOE
    )
    disk = saved_tensors(hf, tmp_path)
    back = to_hf("mixtral", fields, to_ours("mixtral", fields, disk))
    assert all(torch.equal(back[k], v) for k, v in disk.items())


def test_features_a_moe_family_cannot_express_are_named():
    _, base, _ = hf_families.fields_from_hf(make_hf("mixtral").config)
    cases = [
        ("mixtral", dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        ("mixtral", dict(moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias"),
        ("mixtral", dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor 2.5"),
        ("mixtral", dict(moe_router_num_groups=2, moe_router_group_topk=1), "group-limited routing"),
        ("mixtral", dict(moe_expert_capacity_factor=1.0), "token dropping"),
        ("mixtral", dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        ("mixtral", dict(moe_layer_freq=2), "dense layers"),
        ("mixtral", dict(moe_shared_expert_intermediate_size=32), "that is qwen2_moe"),
        ("mixtral", dict(add_bias_linear=True), "biases"),
        ("mixtral", dict(qk_layernorm=True), "that is qwen3_moe"),
        ("qwen3_moe", {}, "without --qk-layernorm"),
        ("qwen2_moe", {}, "without a shared expert"),
        ("qwen2_moe", dict(moe_shared_expert_intermediate_size=32), "without its gate"),
        ("llama", {}, "use --model-type mixtral, qwen2_moe or qwen3_moe"),
        ("mixtral", dict(num_moe_experts=None), "a model without experts"),
    ]
    for family, change, expected in cases:
        with pytest.raises(ToolError, match=expected):
            hf_families.check_expressible(family, {**base, **change})
    with pytest.raises(ToolError, match="config.json attention_bias true"):
        hf_families.fields_from_hf(make_hf("qwen3_moe", attention_bias=True).config)
    with pytest.raises(ToolError, match="config.json use_sliding_window true"):
        hf_families.fields_from_hf(
            transformers.Qwen2MoeConfig(**{**BASE, **FAMILY_KW["qwen2_moe"]}, use_sliding_window=True)
        )


def convert(*args: str) -> int:
    from megatron.training.checkpoint_tool import cli

    return cli.main(["convert", *args])


ROUND_TRIPS = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe_dense_layer": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_convert_both_ways_with_matching_logits(name, tmp_path, capsys):
    from megatron.training.checkpoint_tool import model_check
    from megatron.training.checkpoint_tool.reader import SavedCheckpoint

    family, kw = ROUND_TRIPS[name]
    hf = make_hf(family, **kw)
    src, ours, back = tmp_path / "src", tmp_path / "ours", tmp_path / "back"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron") == 0
    assert convert("--input", str(ours), "--output", str(back), "--to", "hf") == 0
    out = capsys.readouterr().out
    assert out.count("logits check: largest absolute logit difference") == 2, out
    assert f"--num-experts {E} --moe-ffn-hidden-size {F_MOE} --moe-router-topk {TOPK}" in out
    assert "note: config.json router_aux_loss_coef 0.02: pass --moe-aux-loss-coeff 0.02" in out

    ckpt = SavedCheckpoint(str(ours))
    assert ckpt.tensors["decoder.layers.0.mlp.router.weight"][0] == (E, H)
    assert ckpt.tensors["decoder.layers.0.mlp.experts.linear_fc2.weight"][0] == (E, H, F_MOE)
    # Our model from the converted checkpoint against the original HF model, independently of the tool.
    mine = model_check.ours_from_checkpoint(ckpt)
    assert model_check.compare(mine, hf, vocab=VOCAB).max_abs_diff < 1e-4
    # The check can fail: experts one step off are told apart.
    with torch.no_grad():
        mine.decoder.layers[-1].mlp.experts.linear_fc2.weight.add_(0.05)
    assert model_check.compare(mine, hf, vocab=VOCAB).max_abs_diff > 1e-3

    original, again = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(again) == sorted(original)
    for key, value in original.items():
        assert torch.equal(again[key], value), key
    exported = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(exported) is type(hf)
    tokens, _ = model_check.fixed_batch(VOCAB)
    with torch.no_grad():
        diff = exported(input_ids=tokens).logits - hf(input_ids=tokens).logits
    assert diff.abs().max() < 1e-5


def _resave_gpt_model_under_ep2(_, ckpt: str, out: str) -> None:
    """Each of 2 ranks builds our GPTModel under ep2 (2 of the 4 experts each), loads the one-process
    checkpoint ``ckpt`` into it and saves it again through the training's save_checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.parallel_state import build_parallel_state
    from megatron.training.checkpoint_tool import model_check
    from megatron.training.checkpoint_tool.reader import SavedCheckpoint
    from megatron.training.checkpointing import save_checkpoint

    ps = build_parallel_state(ep=2)
    saved = SavedCheckpoint(ckpt)
    cfg = model_check.transformer_config(model_check.model_fields(saved))
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(cfg, spec, 256, 64, parallel_output=False, device="cpu", parallel_state=ps)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, saved.dir)["model"])
    extra = {k: v for k, v in saved.common.items() if k not in ("checkpoint_contents", "finite")}
    save_checkpoint(
        out,
        0,
        model.sharded_state_dict(),
        extra_state=extra,
        save_optim=False,
        save_rng=False,
        parallel_state=ps,
    )


def test_gpt_model_checkpoint_saved_under_expert_parallelism_converts(tmp_path, capsys):
    """Our GPTModel saved under ep2 (each expert tensor two blocks of the global [E, ...] tensor)
    exports with the logits check passing and the original HF files bit-exactly."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from harness import run_distributed

    from megatron.training.checkpoint_tool.reader import SavedCheckpoint

    hf = make_hf("qwen2_moe")
    src, ours, ep2, back = tmp_path / "src", tmp_path / "ours", tmp_path / "ep2", tmp_path / "back"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    run_distributed(_resave_gpt_model_under_ep2, world_size=2, kwargs=dict(ckpt=str(ours), out=str(ep2)))
    ckpt = SavedCheckpoint(str(ep2))
    key = "decoder.layers.1.mlp.experts.linear_fc2.weight"
    blocks = sorted(tuple(c.offsets) for c in ckpt.metadata.state_dict_metadata[key].chunks)
    assert blocks == [(0, 0, 0), (E // 2, 0, 0)]  # saved by the two expert-parallel ranks
    assert convert("--input", str(ep2), "--output", str(back), "--to", "hf") == 0
    assert "logits check: largest absolute logit difference" in capsys.readouterr().out
    original, again = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], v) for k, v in original.items())


def test_converted_moe_trains_with_its_recorded_flags_and_exports_again(tmp_path, capsys):
    """A converted Qwen3-MoE (a dense first layer, norm_topk_prob false) trains one step through
    pretrain_gpt.py with --use-checkpoint-args only; the checkpoint that run saved (which names no
    family) exports as qwen3_moe with the logits check passing."""
    import json

    from megatron.training.cli import run

    src, ours, trained, back = (tmp_path / n for n in ("src", "ours", "trained", "back"))
    make_hf("qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False).save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    flags = (
        f"--load {ours} --use-checkpoint-args --save {trained} --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 200 --num-workers 0 --eval-iters 0 "
        "--train-iters 1 --hidden-dropout 0 --attention-dropout 0"
    ).split()
    assert run(flags) == 0
    assert "--num-experts 4 --moe-ffn-hidden-size 48 --moe-layer-freq" in capsys.readouterr().out
    assert convert("--input", str(trained), "--output", str(back), "--to", "hf") == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out and "logits check: largest absolute logit difference" in out
    written = json.loads((back / "config.json").read_text())
    assert written["mlp_only_layers"] == [0] and written["norm_topk_prob"] is False
    assert written["num_experts"] == E and written["moe_intermediate_size"] == F_MOE


def test_export_to_a_family_that_cannot_express_the_model_is_one_line(tmp_path, capsys):
    hf = make_hf("qwen2_moe")
    hf.save_pretrained(tmp_path / "src")
    assert (
        convert(
            "--input",
            str(tmp_path / "src"),
            "--output",
            str(tmp_path / "ours"),
            "--to",
            "megatron",
            "--no-check",
        )
        == 0
    )
    capsys.readouterr()
    args = ["--input", str(tmp_path / "ours"), "--output", str(tmp_path / "x"), "--to", "hf", "--model-type"]
    assert convert(*args, "qwen3_moe") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--model-type qwen3_moe cannot express shared experts" in err
