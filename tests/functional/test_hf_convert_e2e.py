"""checkpoint.py convert end to end: a checkpoint pretrain_gpt.py trained under tp2 x pp2 with the
distributed optimizer exports to a Hugging Face directory that transformers loads with our logits;
a Hugging Face model imported to our format fine-tunes with pretrain_gpt.py, its loss decreasing."""

from __future__ import annotations

import json

import pytest
import torch
from launch import metrics, torchrun_many

from megatron.training.checkpoint_tool import cli, model_check
from megatron.training.checkpoint_tool.reader import SavedCheckpoint
from megatron.training.cli import run as pretrain

transformers = pytest.importorskip("transformers")

LLAMA_LIKE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--seq-length 32 --max-position-embeddings 32 --hidden-dropout 0 --attention-dropout 0"
).split()
SHORT = "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --num-workers 0".split()


def _hf_logits(hf_dir, vocab: int) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    tokens, positions = model_check.fixed_batch(vocab)
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions).logits


@pytest.mark.slow
def test_tp2_pp2_distopt_checkpoint_exports_with_our_logits(corpus, tmp_path, capsys):
    data, _ = corpus
    layout = (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer".split()
    )
    # tp 2 x divisible-by 1000: the 4096 tokens are padded to 6000 rows, which the export removes.
    common = (
        LLAMA_LIKE + SHORT + data + layout + "--make-vocab-size-divisible-by 1000 --train-iters 3".split()
    )
    runs = {
        "untied": common + ["--untie-embeddings-and-output-weights", "--save", str(tmp_path / "untied")],
        "tied": common + ["--save", str(tmp_path / "tied")],
    }
    torchrun_many(4, list(runs.values()))
    for name in runs:
        save, out = tmp_path / name, tmp_path / f"{name}_hf"
        assert cli.main(["convert", "--input", str(save), "--output", str(out), "--to", "hf"]) == 0
        printed = capsys.readouterr().out
        assert "padding of 1904 rows removed" in printed and "logits check: largest" in printed
        config = json.loads((out / "config.json").read_text())
        assert config["vocab_size"] == 4096 and config["tie_word_embeddings"] == (name == "tied")
        assert config["num_key_value_heads"] == 2 and config["architectures"] == ["LlamaForCausalLM"]
        assert (out / "tokenizer.json").is_file()
        ckpt = SavedCheckpoint(str(save))
        assert ckpt.args["layout"]["tensor_model_parallel_size"] == 2 and ckpt.iteration == 3
        ours = model_check.ours_from_checkpoint(ckpt)  # tp 1, one process, from the same checkpoint
        tokens, positions = model_check.fixed_batch(4096)
        with torch.no_grad():
            mine = ours(tokens, positions, None)[..., :4096]
        assert (mine - _hf_logits(out, 4096)).abs().max() < 1e-4, name


@pytest.mark.slow
def test_hf_model_imports_and_finetunes(corpus, tmp_path, capsys):
    data, _ = corpus
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,  # the corpus tokenizer's
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    src, ours = tmp_path / "hf", tmp_path / "ours"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    assert cli.main(["convert", "--input", str(src), "--output", str(ours), "--to", "megatron"]) == 0
    printed = capsys.readouterr().out
    flags = (
        printed.split("pretrain_gpt.py model flags (or --use-checkpoint-args):\n")[1].splitlines()[0].split()
    )
    log = tmp_path / "metrics.jsonl"
    argv = flags + SHORT + data + ["--seq-length", "32", "--train-iters", "12", "--lr-warmup-iters", "0"]
    assert pretrain(argv + ["--load", str(ours), "--finetune", "--metrics-file", str(log)]) == 0
    out = capsys.readouterr().out
    assert "successfully loaded checkpoint" in out
    losses = {it: r["lm loss"] for it, r in metrics(str(log), "lm loss").items()}
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.3, losses
    assert "logits check: largest absolute logit difference" in printed
