"""Context parallelism through pretrain_gpt.py: every cp layout trains the one-process model.

Same seed, same data, dropout off: per-step losses and grad norms must match the single-process run
to test_layouts' fp32 tolerance (each cp rank holds two zigzag chunks of every sequence; the loss is
normalised over the micro-batch's tokens on all cp ranks, gradients averaged over dp x cp).
"""

import pytest
from launch import torchrun_many
from test_layouts import LLAMA, MODEL, assert_curves_match, curves

from megatron.training.cli import run

# Packed documents: mock documents end in EOD (255) inside the 32-token samples.
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss".split()
# The step's loss over its global token count; the EOD loss mask leaves the cp ranks unequal counts.
PER_TOKEN = "--calculate-per-token-loss --eod-mask-loss".split()

TWO_RANKS = {  # name: (flags, Llama architecture)
    "cp2-p2p": ("--context-parallel-size 2 --cp-comm-type p2p", False),
    "cp2-a2a": ("--context-parallel-size 2 --cp-comm-type a2a", False),
    "cp2-allgather": ("--context-parallel-size 2 --cp-comm-type allgather", False),
    "cp2-p2p-llama": ("--context-parallel-size 2", True),
}
FOUR_RANKS = {
    "cp4-p2p": "--context-parallel-size 4",
    "cp4-a2a+p2p": "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2",
    "cp2xtp2-sp": "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "cp2xpp2": "--context-parallel-size 2 --pipeline-model-parallel-size 2",
    "cp2xdp2-distopt": "--context-parallel-size 2 --use-distributed-optimizer",
}


def _assert_all_match(d, names, ref_of) -> None:
    for name in names:
        ref = curves(f"{d}/{ref_of(name)}.jsonl")
        got = curves(f"{d}/{name}.jsonl")
        assert sorted(got) == sorted(ref) == list(range(1, 11)), name
        assert_curves_match(got, ref, name)


@pytest.mark.slow
def test_two_rank_context_parallel_layouts_match_single_process(tmp_path):
    """cp2 with each comm type (gpt), p2p with GQA + RoPE, and packed documents (document masks
    of the full sequence, reset position ids, EOD loss mask) under cp2 p2p and a2a; and
    --calculate-per-token-loss under cp2."""
    d = tmp_path
    refs = (("ref", []), ("ref-llama", LLAMA), ("ref-packed", PACKED), ("ref-per-token", PER_TOKEN))
    for name, extra in refs:
        assert run(MODEL + extra + ["--metrics-file", f"{d}/{name}.jsonl"]) == 0
    runs = [
        MODEL + (LLAMA if llama else []) + flags.split() + ["--metrics-file", f"{d}/{name}.jsonl"]
        for name, (flags, llama) in TWO_RANKS.items()
    ]
    packed = {"cp2-p2p-packed": "p2p", "cp2-a2a-packed": "a2a"}
    runs += [
        MODEL + PACKED + f"--context-parallel-size 2 --cp-comm-type {t} --metrics-file {d}/{n}.jsonl".split()
        for n, t in packed.items()
    ]
    runs.append(
        MODEL + PER_TOKEN + f"--context-parallel-size 2 --metrics-file {d}/cp2-per-token.jsonl".split()
    )
    torchrun_many(2, runs)
    _assert_all_match(d, TWO_RANKS, lambda n: "ref-llama" if TWO_RANKS[n][1] else "ref")
    _assert_all_match(d, packed, lambda n: "ref-packed")
    _assert_all_match(d, ["cp2-per-token"], lambda n: "ref-per-token")


@pytest.mark.slow
def test_four_rank_context_parallel_layouts_and_cp_resharding(tmp_path):
    """cp4 (p2p, a2a+p2p 2 x 2), cp2 with tp2 + sequence parallel, pp2 and dp2 with the distributed
    optimizer; and a checkpoint saved under cp2 at step 3 (x dp2, distributed optimizer) resumed under
    cp4 and under cp1 (x dp4) on the uninterrupted curve."""
    d = tmp_path
    assert run(MODEL + ["--metrics-file", f"{d}/ref.jsonl"]) == 0
    runs = [MODEL + f.split() + ["--metrics-file", f"{d}/{n}.jsonl"] for n, f in FOUR_RANKS.items()]
    ck = f"{d}/ck"
    save = "--context-parallel-size 2 --use-distributed-optimizer"
    runs.append(MODEL + f"{save} --save {ck} --save-interval 3 --exit-interval 3".split())
    for name, flags in (("resumed-cp4", "--context-parallel-size 4"), ("resumed-cp1", "")):
        runs.append(MODEL + f"{flags} --load {ck} --metrics-file {d}/{name}.jsonl".split())
    outs = torchrun_many(4, runs)
    assert " > context parallelism: cp 4, each sequence of 32 tokens in 8 chunks of 4" in outs[0].stdout
    assert "layout      checkpoint tp1 pp1 cp2 dp2" in outs[-2].stdout
    _assert_all_match(d, FOUR_RANKS, lambda n: "ref")
    ref = curves(f"{d}/ref.jsonl")
    for name in ("resumed-cp4", "resumed-cp1"):
        got = curves(f"{d}/{name}.jsonl")
        assert sorted(got) == list(range(4, 11)), name
        assert_curves_match(got, {it: v for it, v in ref.items() if it > 3}, name)
