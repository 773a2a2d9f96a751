"""checkpoint.py convert: tiny random Hugging Face models (built here, never downloaded) convert to our
checkpoint and back; our model from the converted checkpoint gives the HF model's logits, the
re-exported weights are the original's, and mistakes are one line each."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron.core.dist_checkpointing import load_common_state  # noqa: E402
from megatron.training.checkpoint_tool import cli, model_check  # noqa: E402
from megatron.training.checkpoint_tool.reader import SavedCheckpoint  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=200)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its init (norm weights away from 1, biases away from 0)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def make_hf(kind: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=200, n_positions=64, **kw)
        return _perturbed(transformers.GPT2LMHeadModel(cfg))
    arch = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config = getattr(transformers, arch + "Config")(
        **SMALL, num_key_value_heads=2, max_position_embeddings=64, **kw
    )
    return _perturbed(getattr(transformers, arch + "ForCausalLM")(config))


def convert(*args: str) -> int:
    return cli.main(["convert", *args])


VARIANTS = {
    "llama_gqa_untied": ("llama", dict(tie_word_embeddings=False, rope_theta=5000.0)),
    "llama_tied_biases": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2_qkv_bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
    "gpt2_tied": ("gpt2", dict(activation_function="gelu_new")),
    "gpt2_untied_erf": ("gpt2", dict(activation_function="gelu", tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_keeps_logits_and_weights(name, tmp_path, capsys):
    kind, kw = VARIANTS[name]
    hf = make_hf(kind, **kw)
    src, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron") == 0
    assert convert("--input", str(ours), "--output", str(back), "--to", "hf") == 0
    out = capsys.readouterr().out
    assert out.count("logits check: largest absolute logit difference") == 2

    # Our model from the converted checkpoint against the original HF model, independently of the tool.
    mine = model_check.ours_from_checkpoint(SavedCheckpoint(str(ours)))
    result = model_check.compare(mine, hf, vocab=200)
    assert result.max_abs_diff < 1e-4
    # The check can fail: a model one weight off is told apart.
    with torch.no_grad():
        mine.decoder.layers[1].self_attention.linear_qkv.weight[0, 0] += 0.5
    assert model_check.compare(mine, hf, vocab=200).max_abs_diff > 1e-3

    original, again = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(again) == sorted(original)
    for key, value in original.items():
        assert torch.equal(again[key], value), key
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__]
    assert written["tie_word_embeddings"] == hf.config.tie_word_embeddings


def test_llama3_rope_scaling_matches_at_long_positions(tmp_path, capsys):
    hf = make_hf("llama", tie_word_embeddings=True, rope_scaling=dict(LLAMA3), rope_theta=500000.0)
    src, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron") == 0
    saved = load_common_state(str(ours / "iter_0000000"))["args"]["config"]["model"]
    assert saved["rope_scaling"] is True and saved["rope_scaling_factor"] == 8.0
    assert "--use-rope-scaling --rope-scaling-factor 8.0" in capsys.readouterr().out
    mine = model_check.ours_from_checkpoint(SavedCheckpoint(str(ours)))
    scaled = model_check.compare(mine, hf, vocab=200, first_position=6000).max_abs_diff
    assert scaled < 1e-5
    # Without the scaling the far positions differ beyond the tolerance: the comparison there tests it.
    mine.rope_scaling_factor = None
    assert model_check.compare(mine, hf, vocab=200, first_position=6000).max_abs_diff > max(
        1e-4, 100 * scaled
    )

    assert convert("--input", str(ours), "--output", str(back), "--to", "hf") == 0
    written = json.loads((back / "config.json").read_text())
    assert written["rope_scaling"] == LLAMA3 and written["rope_theta"] == 500000.0
    again = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    tokens, pos = model_check.fixed_batch(200, 6000)
    with torch.no_grad():
        diff = (
            again(input_ids=tokens, position_ids=pos).logits - hf(input_ids=tokens, position_ids=pos).logits
        )
    assert diff.abs().max() < 1e-5


def test_import_records_what_training_writes(tmp_path, capsys):
    hf = make_hf("llama", tie_word_embeddings=False)
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    out = capsys.readouterr().out
    assert "logits check: skipped (--no-check)" in out
    ckpt = SavedCheckpoint(str(ours))
    assert (ours / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    common = ckpt.common
    for key in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
        assert common[key] == 0
    assert common["num_floating_point_operations_so_far"] == 0 and common["checkpoint_version"] == 3.0
    assert common["converted_from"] == os.path.abspath(src)
    args = ckpt.args
    assert args["padded_vocab_size"] == 256 and args["vocab_size"] == 200  # 200 -> a multiple of 128
    assert args["num_query_groups"] == 2 and args["untie_embeddings_and_output_weights"] is True
    assert args["config"]["model"]["num_query_groups"] == 2
    assert args["config"]["training"]["max_position_embeddings"] == 64
    assert ckpt.tensors["embedding.word_embeddings.weight"][0] == (256, 32)
    assert ckpt.tensors["decoder.layers.0.mlp.linear_fc1.weight"][0] == (2, 48, 32)  # what training writes
    assert not any(k.startswith("optimizer") for k in ckpt.tensors)
    assert torch.count_nonzero(ckpt.read("output_layer.weight")[200:]) == 0  # padding rows are zeros
    line = out.split("pretrain_gpt.py model flags (or --use-checkpoint-args):\n")[1].splitlines()[0]
    assert "--group-query-attention --num-query-groups 2" in line and "--padded-vocab-size 256" in line


def test_tokenizer_is_carried_both_ways(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = make_hf("llama", tie_word_embeddings=True)
    src, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    hf.save_pretrained(src)
    vocab = {f"t{i}": i for i in range(199)} | {"</s>": 199}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    assert (ours / "tokenizer" / "tokenizer.json").is_file()
    saved = SavedCheckpoint(str(ours)).config["tokenizer"]
    assert saved == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(ours / "tokenizer")}
    assert convert("--input", str(ours), "--output", str(back), "--to", "hf") == 0
    again = transformers.AutoTokenizer.from_pretrained(back)
    assert again.encode("t5 t7 t198", add_special_tokens=False) == [5, 7, 198]
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == 199
    # A run whose --tokenizer-model is a bare tokenizer.json: eos is the eod our tokenizer finds.
    bare = tmp_path / "bare.json"
    tok.save(str(bare))
    ckpt = SavedCheckpoint(str(ours))
    hf_tok = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(bare)}
    args = {**ckpt.args, "config": {**ckpt.args["config"], "tokenizer": hf_tok}}
    _resave(ckpt, tmp_path / "ours_bare", model_check.model_fields(ckpt), args)
    assert (
        convert("--input", str(tmp_path / "ours_bare"), "--output", str(tmp_path / "b2"), "--to", "hf") == 0
    )
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "b2").eos_token == "</s>"
    assert json.loads((tmp_path / "b2" / "config.json").read_text())["eos_token_id"] == 199
    capsys.readouterr()


def test_sharded_bf16_export(tmp_path, capsys):
    hf = make_hf("qwen2", tie_word_embeddings=False)
    src, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    args = ["--input", str(ours), "--output", str(back), "--to", "hf", "--dtype", "bfloat16"]
    assert convert(*args, "--max-shard-size", "20KB") == 0
    assert "logits check: largest absolute logit difference" in capsys.readouterr().out
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(
        os.path.getsize(back / f) < 20_000 + 30_000 for f in files
    )  # a piece over the limit stands alone
    held = {}
    for f in files:
        held.update(load_file(back / f))
    assert held.keys() == hf.state_dict().keys()
    for key, value in hf.state_dict().items():
        assert held[key].dtype == torch.bfloat16 and torch.equal(held[key], value.to(torch.bfloat16)), key
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # The sharded bf16 directory reads back (through its index), keeping bf16.
    again = tmp_path / "again"
    assert convert("--input", str(back), "--output", str(again), "--to", "megatron") == 0
    assert "weights in torch.bfloat16" in capsys.readouterr().out
    ckpt = SavedCheckpoint(str(again))
    assert ckpt.tensors["decoder.layers.1.self_attention.linear_qkv.weight"][1] == torch.bfloat16


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_refusals_are_one_line(tmp_path, capsys):
    hf = make_hf("llama", tie_word_embeddings=True)
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf.save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    capsys.readouterr()
    cases = [
        (
            ["--input", str(ours), "--output", str(tmp_path / "a"), "--to", "hf", "--model-type", "gpt2"],
            "--model-type gpt2 needs position_embedding_type learned_absolute",
        ),
        (["--input", str(src), "--output", str(ours), "--to", "megatron"], "is not empty"),
        (
            [
                "--input",
                str(src),
                "--output",
                str(tmp_path / "b"),
                "--to",
                "megatron",
                "--model-type",
                "llama",
            ],
            "--model-type applies to --to hf only",
        ),
        (
            ["--input", str(ours), "--output", str(tmp_path / "c"), "--to", "hf", "--max-shard-size", "big"],
            "--max-shard-size 'big'",
        ),
        (
            ["--input", str(tmp_path / "none"), "--output", str(tmp_path / "d"), "--to", "megatron"],
            "is not a directory",
        ),
        (["--input", str(ours), "--output", str(tmp_path / "e"), "--to", "megatron"], "holds no config.json"),
        (
            ["--input", str(ours), "--output", str(tmp_path / "f"), "--to", "hf", "--vocab-size", "999"],
            "--vocab-size 999 exceeds",
        ),
    ]
    for args, expected in cases:
        assert convert(*args) == 2, args
        assert expected in _error(capsys), args

    bert = tmp_path / "bert"
    transformers.BertConfig(**{k: v for k, v in SMALL.items() if k != "intermediate_size"}).save_pretrained(
        bert
    )
    assert convert("--input", str(bert), "--output", str(tmp_path / "g"), "--to", "megatron") == 2
    assert "model_type 'bert' is not converted" in _error(capsys)


def test_failed_logits_check_exits_2(tmp_path, capsys, monkeypatch):
    hf = make_hf("gpt2")
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf.save_pretrained(src)
    real = model_check.ours_from_checkpoint

    def off_by_one_weight(*a, **kw):
        model = real(*a, **kw)
        with torch.no_grad():
            model.decoder.final_layernorm.bias[0] += 0.1
        return model

    monkeypatch.setattr(model_check, "ours_from_checkpoint", off_by_one_weight)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron") == 2
    assert "logits check failed: largest absolute logit difference" in _error(capsys)


def test_features_hf_cannot_express_are_named(tmp_path, capsys):
    from megatron.training.checkpoint_tool import hf_families
    from megatron.training.checkpoint_tool.errors import ToolError

    base = model_check.model_fields(_imported(tmp_path, capsys))
    for change, expected in (
        (dict(qk_layernorm=True), "--qk-layernorm"),
        (dict(rotary_percent=0.5), "--rotary-percent 0.5"),
        (dict(add_bias_linear=False, add_qkv_bias=True), "that is Qwen2"),
    ):
        with pytest.raises(ToolError, match=expected):
            hf_families.check_expressible("llama", {**base, **change})
    with pytest.raises(ToolError, match="biases beyond q/k/v"):
        hf_families.check_expressible("qwen2", {**base, "add_bias_linear": True})


def _imported(tmp_path, capsys, src=None) -> SavedCheckpoint:
    """Our checkpoint of ``src`` (default: a new tied Llama), converted without the check."""
    ours = tmp_path / "ours"
    if src is None:
        src = tmp_path / "hf"
        make_hf("llama", tie_word_embeddings=True).save_pretrained(src)
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron", "--no-check") == 0
    capsys.readouterr()
    return SavedCheckpoint(str(ours))


def test_pytorch_model_bin_with_base_model_names(tmp_path, capsys):
    """GPT-2 as the original hub files store it: pytorch_model.bin, names without ``transformer.``."""
    hf = make_hf("gpt2")
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf.config.save_pretrained(src)
    bare = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    torch.save(bare, src / "pytorch_model.bin")
    assert convert("--input", str(src), "--output", str(ours), "--to", "megatron") == 0
    assert "logits check: largest absolute logit difference" in capsys.readouterr().out
    ckpt = SavedCheckpoint(str(ours))
    assert torch.equal(ckpt.read("embedding.position_embeddings.weight"), hf.transformer.wpe.weight.detach())


def test_layernorm_1p_is_folded_on_export(tmp_path, capsys):
    """A model with --apply-layernorm-1p (norms scale by 1 + w) exports with w + 1 as HF's norm weight,
    in fp32 and in bf16 (rounded as our bf16 model computes 1 + w)."""
    from megatron.training.checkpoint_tool import hf_import

    hf = make_hf("llama", tie_word_embeddings=False)
    src, one_p = tmp_path / "hf", tmp_path / "one_p"
    hf.save_pretrained(src)
    ckpt = _imported(tmp_path, capsys, src)
    fields = {**model_check.model_fields(ckpt), "apply_layernorm_1p": True}
    _resave(ckpt, one_p, fields, hf_import.saved_args(fields, 64, 200, 256, None), norm_shift=-1.0)
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"back_{dtype}"
        assert convert("--input", str(one_p), "--output", str(out), "--to", "hf", "--dtype", dtype) == 0
        assert "logits check: largest absolute logit difference" in capsys.readouterr().out
        norm = load_file(out / "model.safetensors")["model.layers.0.input_layernorm.weight"]
        want = hf.model.layers[0].input_layernorm.weight.detach().to(norm.dtype)
        torch.testing.assert_close(norm, want, atol=1e-6 if dtype == "float32" else 8e-3, rtol=0)


def _resave(ckpt: SavedCheckpoint, path, fields: dict, args: dict, norm_shift: float = 0.0) -> None:
    """``ckpt``'s weights saved again under ``path`` as a model of ``fields`` with ``args`` (norm
    weights shifted by ``norm_shift``), through the training's save_checkpoint."""
    from megatron.training.checkpointing import save_checkpoint

    model = model_check.empty_model(fields, ckpt.args["padded_vocab_size"], 64, torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = ckpt.read(name).reshape(param.shape)
            param.copy_(value + norm_shift if name.endswith("layernorm.weight") else value)
    extra = {k: v for k, v in ckpt.common.items() if k not in ("checkpoint_contents", "finite")}
    extra["args"] = args
    save_checkpoint(
        str(path), 0, model.sharded_state_dict(), extra_state=extra, save_optim=False, save_rng=False
    )


def test_unrecorded_vocabulary_size(tmp_path, capsys):
    """Without args['vocab_size'] the size comes from --vocab-size or the saved tokenizer; else one line."""
    ckpt = _imported(tmp_path, capsys)
    fields = model_check.model_fields(ckpt)
    args = {k: v for k, v in ckpt.args.items() if k != "vocab_size"}
    _resave(ckpt, tmp_path / "bare", fields, args)
    out = ["--output", str(tmp_path / "x"), "--to", "hf"]
    assert convert("--input", str(tmp_path / "bare"), *out) == 2
    assert "pass --vocab-size N" in _error(capsys)
    assert convert("--input", str(tmp_path / "bare"), *out, "--vocab-size", "200") == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["vocab_size"] == 200
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 200}
    _resave(ckpt, tmp_path / "null", fields, {**args, "config": {**args["config"], "tokenizer": null}})
    assert convert("--input", str(tmp_path / "null"), "--output", str(tmp_path / "y"), "--to", "hf") == 0
    assert json.loads((tmp_path / "y" / "config.json").read_text())["vocab_size"] == 200
    capsys.readouterr()
