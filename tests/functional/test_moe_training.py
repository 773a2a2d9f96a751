"""A mixture-of-experts model through pretrain_gpt.py on the CPU: it trains, and every log line,
the metrics file and the start-up report carry the MoE figures (aux and z losses, expert load
imbalance, dropped tokens; per layer with --moe-per-layer-logging); on 2 ranks, dp2, ep2 with
either dispatcher, ep2 under FSDP2 and cp2 train the one-process model (losses, grad norms and the
MoE figures)."""

import math

import pytest
from launch import metrics, torchrun_many
from test_layouts import MODEL, assert_curves_match, curves

from megatron.training.cli import run

MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2".split()


@pytest.mark.slow
def test_moe_model_trains_and_logs_its_metrics(tmp_path, capsys):
    flags = (
        MODEL
        + MOE
        + "--moe-z-loss-coeff 1e-3 --moe-layer-freq [0]*1+[1]*1 --moe-per-layer-logging --moe-grouped-gemm".split()
        + "--moe-expert-capacity-factor 1.0 --train-iters 4 --log-interval 2".split()
        + ["--metrics-file", f"{tmp_path}/m.jsonl"]
    )
    assert run(flags) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if " iteration " in ln and "lm loss" in ln]
    assert len(lines) == 3  # iterations 1, 2 and 4
    for ln in lines:
        assert "load_balancing_loss: " in ln and "z_loss: " in ln and "expert load max/mean: " in ln
        assert "dropped tokens: " in ln
    assert "   experts: 4 experts of " in out and " > experts: 4 of FFN" in out  # kernels and layout
    recs = metrics(f"{tmp_path}/m.jsonl", "lm loss")
    assert sorted(recs) == [1, 2, 4]
    for rec in recs.values():
        # Switch loss E * sum f_i P_i >= 1 (1 when balanced), z-loss > 0, imbalance >= 1.
        assert 0.99 < rec["load_balancing_loss"] < 4 and rec["z_loss"] > 0
        assert rec["expert_load_imbalance"] >= 1.0 and 0.0 <= rec["dropped_token_fraction"] < 1.0
        assert "moe/load_balancing_loss_layer_1" in rec and "moe/expert_load_imbalance_layer_1" in rec
        assert not any(k.endswith("_layer_0") for k in rec)  # layer 0 is dense
    first, last = recs[1]["lm loss"], recs[4]["lm loss"]
    assert math.isfinite(last) and last < first


# Aux and z losses strong enough that their gradients dominate: a wrong aux-loss scale under cp
# (the cp ranks' shares of a sequence's loss, averaged over dp x cp) shows in the grad norm.
STRONG = "--moe-aux-loss-coeff 1.0 --moe-z-loss-coeff 0.1".split()


@pytest.mark.slow
def test_two_rank_expert_layouts_match_single_process(tmp_path):
    d = tmp_path
    flags = MODEL + MOE + ["--moe-z-loss-coeff", "1e-3"]
    assert run(flags + ["--metrics-file", f"{d}/ref.jsonl"]) == 0
    assert run(flags + STRONG + ["--metrics-file", f"{d}/ref-strong.jsonl"]) == 0
    layouts = {  # name: (flags, reference)
        "dp2": ([], "ref"),
        "ep2-allgather": (["--expert-model-parallel-size", "2"], "ref"),
        "ep2-alltoall": (
            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall".split(),
            "ref",
        ),
        "cp2-strong": (["--context-parallel-size", "2", *STRONG], "ref-strong"),
        # FSDP2: the experts are one unit sharded over expert-dp (here 1 rank), the rest over dp2
        "ep2-fsdp2": ("--expert-model-parallel-size 2 --use-torch-fsdp2".split(), "ref"),
    }
    torchrun_many(
        2, [flags + extra + ["--metrics-file", f"{d}/{n}.jsonl"] for n, (extra, _) in layouts.items()]
    )
    for name, (_, ref_name) in layouts.items():
        ref, ref_moe = curves(f"{d}/{ref_name}.jsonl"), metrics(f"{d}/{ref_name}.jsonl", "lm loss")
        got = curves(f"{d}/{name}.jsonl")
        assert sorted(got) == sorted(ref) == list(range(1, 11)), name
        assert_curves_match(got, ref, name)
        for it, rec in metrics(f"{d}/{name}.jsonl", "lm loss").items():
            for key in ("load_balancing_loss", "z_loss", "expert_load_imbalance"):
                assert rec[key] == pytest.approx(ref_moe[it][key], rel=1e-5), (name, it, key)


@pytest.mark.slow
def test_recompute_trains_and_logs_as_without(tmp_path):
    """Recomputed MoE layers route again in backward, whole layers (--recompute-granularity full) or
    the MoE layers alone (selective, --recompute-modules moe): the same losses, grad norms and MoE
    figures (the recompute records no second copy of the aux losses or token counts)."""
    flags = MODEL + MOE + ["--moe-z-loss-coeff", "1e-3", "--train-iters", "3"]
    full = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
    moe = "--recompute-granularity selective --recompute-modules core_attn moe".split()
    assert run(flags + ["--metrics-file", f"{tmp_path}/ref.jsonl"]) == 0
    ref = metrics(f"{tmp_path}/ref.jsonl", "lm loss")
    for name, extra in (("full", full), ("moe", moe)):
        assert run(flags + extra + ["--metrics-file", f"{tmp_path}/{name}.jsonl"]) == 0
        got = metrics(f"{tmp_path}/{name}.jsonl", "lm loss")
        assert sorted(got) == sorted(ref) == [1, 2, 3]
        for it in ref:
            for key in ("lm loss", "grad-norm", "load_balancing_loss", "z_loss", "expert_load_imbalance"):
                assert got[it][key] == pytest.approx(ref[it][key], rel=1e-6), (name, it, key)
