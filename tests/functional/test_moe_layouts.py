"""Expert-parallel layouts through pretrain_gpt.py: every layout trains the one-process MoE model.

A Mixtral-like toy (4 SwiGLU experts, top-2, aux-loss balancing at 1e-2, fp32 routing, dropout off)
with the global batch of 8 in every layout, so that the reference is one run: per-step losses and
grad norms must match the single-process run to test_layouts' fp32 tolerance. Expert parallelism is
carved from dp x cp (ep2 x cp2 holds one sequence's halves on the two experts' ranks); ep2 x tp2 has
etp2 (Megatron's default: etp = tp); --expert-tensor-parallel-size 2 alone splits only the experts.
Both token dispatchers run across the set. The one-process reference runs the experts in a loop;
ep2 x cp2 with alltoall runs its two local experts in one torch._grouped_mm per linear
(--moe-grouped-gemm: this torch has the CPU op for fp32, and these shapes meet its 16-byte stride
rule), so that run also shows grouped GEMM equals the loop. tests/functional/test_moe_training.py
holds ep2 and dp2 on two ranks.
"""

import pytest
from launch import metrics, torchrun_many
from test_layouts import LLAMA, MODEL, assert_curves_match, curves

from megatron.training.cli import run

MOE = (
    MODEL
    + LLAMA
    + "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32".split()
)
A2A = "--moe-token-dispatcher-type alltoall"

TWO_RANKS = {
    "etp2-allgather": "--expert-tensor-parallel-size 2",
    "etp2-alltoall": f"--expert-tensor-parallel-size 2 {A2A}",
    "ep2xcp2-allgather": "--expert-model-parallel-size 2 --context-parallel-size 2",
    "ep2xcp2-alltoall-grouped": f"--expert-model-parallel-size 2 --context-parallel-size 2 {A2A} --moe-grouped-gemm",
}
FOUR_RANKS = {
    "ep4-alltoall": f"--expert-model-parallel-size 4 {A2A}",
    "ep2xtp2-sp-allgather": "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "ep2xtp2-sp-alltoall": f"--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel {A2A}",
    "ep2xetp2-allgather": "--expert-model-parallel-size 2 --expert-tensor-parallel-size 2",
    "ep2xpp2-alltoall": f"--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 {A2A}",
}


def _reference(d) -> dict:
    assert run(MOE + ["--metrics-file", f"{d}/ref.jsonl"]) == 0
    ref = curves(f"{d}/ref.jsonl")
    assert sorted(ref) == list(range(1, 11))
    return ref


def _assert_all_match(d, names, ref) -> None:
    """Losses and grad norms, and the logged MoE figures (the aux loss and the expert load over the
    whole batch: the same numbers whatever the layout)."""
    for name in names:
        got = curves(f"{d}/{name}.jsonl")
        assert sorted(got) == sorted(ref), name
        assert_curves_match(got, ref, name)
        _assert_moe_figures_match(d, name)


def _assert_moe_figures_match(d, name: str) -> None:
    ref = metrics(f"{d}/ref.jsonl", "lm loss")
    for it, rec in metrics(f"{d}/{name}.jsonl", "lm loss").items():
        for key in ("load_balancing_loss", "expert_load_imbalance"):
            assert rec[key] == pytest.approx(ref[it][key], rel=1e-5), (name, it, key)


@pytest.mark.slow
def test_two_rank_expert_layouts_match_single_process(tmp_path):
    """etp2 (experts split, dense layers replicated over dp2) and ep2 x cp2, each dispatcher (grouped
    GEMM with alltoall)."""
    ref = _reference(tmp_path)
    torchrun_many(
        2, [MOE + f.split() + ["--metrics-file", f"{tmp_path}/{n}.jsonl"] for n, f in TWO_RANKS.items()]
    )
    _assert_all_match(tmp_path, TWO_RANKS, ref)


@pytest.mark.slow
def test_four_rank_expert_layouts_and_ep_resharding(tmp_path):
    """ep4, ep2 x tp2 with sequence parallelism (each dispatcher), ep2 x etp2 over dense dp4,
    ep2 x pp2, and ep2 x pp2 with virtual stages (4 layers, the first dense); and a checkpoint saved under ep2 (x expert-dp 2, distributed optimizer) at step 3
    resumed under ep4 (allgather) and in one process (ep1) on the uninterrupted curve."""
    d = tmp_path
    ref = _reference(d)
    runs = [MOE + f.split() + ["--metrics-file", f"{d}/{n}.jsonl"] for n, f in FOUR_RANKS.items()]
    ck = f"{d}/ck"
    save = "--expert-model-parallel-size 2 --use-distributed-optimizer"
    runs.append(MOE + f"{save} --save {ck} --save-interval 3 --exit-interval 3".split())
    ep4 = "--expert-model-parallel-size 4 --use-distributed-optimizer"
    runs.append(MOE + f"{ep4} --load {ck} --metrics-file {d}/resumed-ep4.jsonl".split())
    # ep2 x pp2 with virtual stages on a 4-layer model (a dense first layer), against its own reference
    deep = list(MOE) + ["--moe-layer-freq", "[0,1,1,1]"]
    deep[deep.index("--num-layers") + 1] = "4"
    vpp = f"--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 {A2A}"
    vpp += " --num-layers-per-virtual-pipeline-stage 1"
    runs.append(deep + vpp.split() + ["--metrics-file", f"{d}/ep2xpp2-vpp2.jsonl"])
    outs = torchrun_many(4, runs)
    resumed = outs[-2].stdout  # the ep4 resume (the vpp run is last)
    assert f"resuming from {ck}/iter_0000003: iteration 3" in resumed
    assert "layout      checkpoint tp1 pp1 dp4 ep2 etp1 " in resumed
    assert "now tp1 pp1 dp4 ep4 etp1 " in resumed
    assert "--expert-model-parallel-size: 2 -> 4 (allowed)" in resumed
    _assert_all_match(d, FOUR_RANKS, ref)
    assert run(deep + ["--metrics-file", f"{d}/ref-deep.jsonl"]) == 0
    got, ref_deep = curves(f"{d}/ep2xpp2-vpp2.jsonl"), curves(f"{d}/ref-deep.jsonl")
    assert sorted(got) == sorted(ref_deep) == list(range(1, 11))
    assert_curves_match(got, ref_deep, "ep2xpp2-vpp2")
    assert run(MOE + f"--load {ck} --metrics-file {d}/resumed-ep1.jsonl".split()) == 0
    for name in ("resumed-ep4", "resumed-ep1"):
        got = curves(f"{d}/{name}.jsonl")
        assert sorted(got) == list(range(4, 11)), name
        assert_curves_match(got, {it: v for it, v in ref.items() if it > 3}, name)
        _assert_moe_figures_match(d, name)
