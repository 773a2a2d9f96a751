"""Layout invariance through pretrain_gpt.py: every parallel layout trains the one-process model.

Same seed, same data, dropout off: per-step losses and grad norms must match the single-process
run to tight fp32 tolerance (the order of floating-point reductions differs, nothing else).
"""

import os

import pytest
from launch import metrics, torchrun, torchrun_by_size, torchrun_many

from megatron.training.cli import run

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --mock-data --vocab-size 256 "
    "--num-workers 0 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 "
    "--train-iters 10"
).split()
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights".split()
)


def curves(path: str) -> dict[int, tuple[float, float]]:
    """Iteration -> (lm loss, grad norm)."""
    return {it: (r["lm loss"], r["grad-norm"]) for it, r in metrics(path, "lm loss").items()}


def assert_curves_match(got: dict, ref: dict, name: str) -> None:
    """Every step of ``ref`` is in ``got`` with the same loss and grad norm (fp32 reduction-order tolerance)."""
    for it, (loss, gnorm) in ref.items():
        assert got[it][0] == pytest.approx(loss, rel=2e-5, abs=1e-6), (name, it)
        assert got[it][1] == pytest.approx(gnorm, rel=1e-4, abs=1e-6), (name, it)


def save_then_resume(tmp_path, save: tuple[int, str], load: tuple[int, str]) -> None:
    """6 steps of the Llama-style model: save at 3 under ``save`` = (processes, flags), resume under
    ``load``; the losses must be those of the uninterrupted one-process run."""
    args = (" ".join(MODEL).replace("--train-iters 10", "--train-iters 6") + " " + " ".join(LLAMA)).split()
    assert run(args + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    ck = f"{tmp_path}/ck"
    for (nproc, flags), extra in (
        (save, f"--save {ck} --save-interval 3 --exit-interval 3"),
        (load, f"--load {ck}"),
    ):
        argv = args + f"--metrics-file {tmp_path}/r.jsonl {flags} {extra}".split()
        if nproc == 1:
            assert run(argv) == 0
        else:
            torchrun(nproc, argv)
    ref, got = curves(f"{tmp_path}/ref.jsonl"), curves(f"{tmp_path}/r.jsonl")
    assert sorted(got) == list(range(1, 7))
    for it in ref:
        assert got[it][0] == pytest.approx(ref[it][0], rel=2e-5), it


LAYOUTS = {
    "tp2": (2, "--tensor-model-parallel-size 2"),
    "tp2-sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "dp2": (2, ""),
    "dp2-overlap": (2, "--overlap-grad-reduce --ddp-bucket-size 2000"),
    "tp2xdp2-sp": (4, "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"),
    "dp2-distopt": (2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 2000"),
    "dp2-distopt-offload": (
        2,
        "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 2000 --optimizer-cpu-offload "
        "--optimizer-offload-fraction 0.5 --overlap-cpu-optimizer-d2h-h2d",
    ),
    "tp2xdp2-sp-distopt": (
        4,
        "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_layouts_match_single_process(tmp_path, arch):
    base = MODEL + (LLAMA if arch == "llama" else [])
    assert run(base + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    ref = curves(f"{tmp_path}/ref.jsonl")
    assert sorted(ref) == list(range(1, 11))
    layouts = {
        name: (nproc, base + extra.split() + ["--metrics-file", f"{tmp_path}/{name}.jsonl"])
        for name, (nproc, extra) in LAYOUTS.items()
        # data parallelism does not touch the architecture; covered by the gpt case
        if not (arch == "llama" and name in ("dp2", "dp2-overlap", "dp2-distopt", "dp2-distopt-offload"))
    }
    torchrun_by_size(layouts)
    for name in layouts:
        got = curves(f"{tmp_path}/{name}.jsonl")
        assert sorted(got) == sorted(ref), name
        assert_curves_match(got, ref, name)


# Issue 7's layouts of one 8-GPU node, on 8 gloo processes at toy scale: a Llama-3-8B-like model (GQA
# with 2 query heads per group, so tp8 leaves one group per rank; untied embeddings; 8 layers for
# pp4 x 2 virtual stages). The vocabulary padding divisor is lowered so that every layout, tp8
# included, pads 256 to 256 as the single process does (Megatron pads to a multiple of divisor x tp).
EIGHT_RANK_MODEL = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 16 --group-query-attention "
    "--num-query-groups 8 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
    "--global-batch-size 16 --lr 3e-3 --lr-warmup-iters 2 --mock-data --vocab-size 256 "
    "--make-vocab-size-divisible-by 32 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--hidden-dropout 0 --attention-dropout 0 --train-iters 6 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights"
).split()
EIGHT_RANK_LAYOUTS = {
    "dp8": "--overlap-grad-reduce",
    "tp2xdp4-sp": "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce",
    "tp4xdp2-sp-distopt": "--tensor-model-parallel-size 4 --sequence-parallel --overlap-grad-reduce "
    "--use-distributed-optimizer",
    "tp8-sp": "--tensor-model-parallel-size 8 --sequence-parallel",
    "tp2xpp2xdp2-sp-distopt": "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
    "--overlap-grad-reduce --use-distributed-optimizer",
    "tp2xpp4-vpp2-sp": "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4 "
    "--num-layers-per-virtual-pipeline-stage 1",
}


RESHARD_SAVE = EIGHT_RANK_LAYOUTS["tp2xpp2xdp2-sp-distopt"]
RESHARD_LOAD = "--tensor-model-parallel-size 4 --sequence-parallel --overlap-grad-reduce"


@pytest.fixture(scope="module")
def eight_rank_runs(tmp_path_factory):
    """The folder of the single-process reference (ref.jsonl) and of the eight-rank runs of the two
    tests below, which share one launch (launch.torchrun_many): every layout of EIGHT_RANK_LAYOUTS
    (<name>.jsonl), then a save under RESHARD_SAVE at step 3 and its resume under RESHARD_LOAD
    (resumed.jsonl)."""
    d = tmp_path_factory.mktemp("eight_rank")
    assert run(EIGHT_RANK_MODEL + f"--metrics-file {d}/ref.jsonl".split()) == 0
    ck, out = f"{d}/ck", f"{d}/resumed.jsonl"
    layouts = [
        EIGHT_RANK_MODEL + extra.split() + ["--metrics-file", f"{d}/{name}.jsonl"]
        for name, extra in EIGHT_RANK_LAYOUTS.items()
    ]
    save = (
        RESHARD_SAVE.split() + f"--save {ck} --save-interval 3 --exit-interval 3 --metrics-file {out}".split()
    )
    load = RESHARD_LOAD.split() + f"--load {ck} --metrics-file {out}".split()
    torchrun_many(8, [*layouts, EIGHT_RANK_MODEL + save, EIGHT_RANK_MODEL + load])
    return d


@pytest.mark.slow
def test_eight_rank_layouts_match_single_process(eight_rank_runs):
    ref = curves(f"{eight_rank_runs}/ref.jsonl")
    assert sorted(ref) == list(range(1, 7))
    for name in EIGHT_RANK_LAYOUTS:
        got = curves(f"{eight_rank_runs}/{name}.jsonl")
        assert sorted(got) == sorted(ref), name
        assert_curves_match(got, ref, name)


@pytest.mark.slow
def test_eight_rank_checkpoint_reshards_across_tp_pp_dp(eight_rank_runs):
    """Saved under tp2 x pp2 x dp2 with the distributed optimizer at step 3, resumed under tp4 x dp2 with
    the plain optimizer: the six steps are those of the uninterrupted single process."""
    ref, got = curves(f"{eight_rank_runs}/ref.jsonl"), curves(f"{eight_rank_runs}/resumed.jsonl")
    assert sorted(got) == list(range(1, 7))
    assert_curves_match(got, ref, "resumed")


@pytest.mark.slow
def test_simple_train_loop_example():
    res = torchrun(2, [], script=os.path.join("examples", "run_simple_train_loop.py"), timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("Iteration ")]
    assert len(lines) == 5 and lines[0].startswith("Iteration 0: Losses reduced: {'lm loss': ")
    assert "Successfully loaded the model" in res.stdout


@pytest.mark.slow
def test_exact_resume_with_tp_dropout(tmp_path):
    """tp2 + sequence parallel with dropout: the tensor-parallel RNG states are checkpointed too, so
    10 + 10 steps reproduce 20 straight steps bitwise."""
    args = (
        " ".join(MODEL)
        .replace("--hidden-dropout 0 --attention-dropout 0", "--hidden-dropout 0.1 --attention-dropout 0.1")
        .replace("--train-iters 10", "--train-iters 20")
        + " --tensor-model-parallel-size 2 --sequence-parallel"
    ).split()
    ck = f"{tmp_path}/ck"
    torchrun_many(
        2,
        [
            args + ["--metrics-file", f"{tmp_path}/straight.jsonl"],
            args
            + f"--save {ck} --save-interval 10 --exit-interval 10 --metrics-file {tmp_path}/r.jsonl".split(),
            args + f"--save {ck} --load {ck} --metrics-file {tmp_path}/r.jsonl".split(),
        ],
    )
    straight, resumed = curves(f"{tmp_path}/straight.jsonl"), curves(f"{tmp_path}/r.jsonl")
    assert sorted(resumed) == list(range(1, 21))
    assert straight == resumed


@pytest.mark.slow
@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 2)])
def test_checkpoint_reshards_across_tensor_parallel_sizes(tmp_path, save_tp, load_tp):
    """Save under one tp size, resume under another (weights and optimizer state): the continued
    losses equal the uninterrupted one-process run. SwiGLU exercises the stacked fc1 layout."""
    save_then_resume(
        tmp_path,
        (save_tp, f"--tensor-model-parallel-size {save_tp}"),
        (load_tp, f"--tensor-model-parallel-size {load_tp}"),
    )


@pytest.mark.slow
def test_per_token_loss_is_layout_invariant(tmp_path):
    """--calculate-per-token-loss divides by the step's global token count; with --eod-mask-loss the
    counts differ per micro-batch, so only a correct global normalisation makes dp2 and tp2 match."""
    args = MODEL + "--calculate-per-token-loss --eod-mask-loss".split()  # eod id 255 recurs in mock documents
    assert run(args + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    ref = curves(f"{tmp_path}/ref.jsonl")
    layouts = (("dp2", ""), ("tp2", "--tensor-model-parallel-size 2"))
    torchrun_many(
        2, [args + extra.split() + ["--metrics-file", f"{tmp_path}/{name}.jsonl"] for name, extra in layouts]
    )
    for name, _ in layouts:
        assert_curves_match(curves(f"{tmp_path}/{name}.jsonl"), ref, name)


@pytest.mark.slow
@pytest.mark.parametrize("save,load", [("dp2-distopt", "dp1"), ("dp1", "dp2-distopt")])
def test_distributed_optimizer_checkpoints_reshard(tmp_path, save, load):
    """The distributed optimizer saves each param's state from its owner in the layout of the plain
    optimizer: a run saved under one resumes under the other (and another DP size) with the losses of
    the uninterrupted one-process run."""
    layouts = {"dp1": (1, ""), "dp2-distopt": (2, "--use-distributed-optimizer")}
    save_then_resume(tmp_path, layouts[save], layouts[load])


# The Llama-style model in bf16, wider and at a higher learning rate, so that FP8 moves its loss measurably
FP8_BASE = (
    " ".join(MODEL + LLAMA).replace("--hidden-size 32", "--hidden-size 64").replace("--lr 3e-3", "--lr 1e-2")
    + " --bf16"
).split()
DELAYED_FP8 = "--fp8-format hybrid --fp8-recipe delayed".split()
FP8_LAYOUTS = {  # name: (processes, flags, FP8 linears on rank 0)
    "tp2-sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel", 8),
    "dp2-overlap": (2, "--overlap-grad-reduce --ddp-bucket-size 2000", 8),
    "pp2": (2, "--pipeline-model-parallel-size 2", 4),
    "cp2": (2, "--context-parallel-size 2", 8),  # amaxes over tp x dp x cp: cp ranks share scales
    "tp2xdp2-sp-distopt": (
        4,
        "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer",
        8,
    ),
    "pp2xdp2": (
        4,
        "--pipeline-model-parallel-size 2 --overlap-grad-reduce",
        4,
    ),  # amax reduction beside the schedule
}


@pytest.mark.slow
def test_fp8_trains_under_every_layout(tmp_path, monkeypatch, capsys):
    """Delayed-scaling FP8 (emulated on the CPU: MEGATRON_FP8_EMULATE=1) under tensor + sequence,
    data (overlapped reduction), pipeline and context parallelism and the distributed optimizer, with the amaxes
    reduced over each stage's ranks: FP8 is on in each run, and the losses follow the one-process FP8
    run within 1% (the FP8 loss criterion of docs/performance.md). Not bitwise: the amax histories
    advance per micro-batch on each rank, and at this learning rate the runs' rounding differences
    grow to ~0.3% of the loss (FP8 itself moves it ~0.25% from bf16 here)."""
    monkeypatch.setenv("MEGATRON_FP8_EMULATE", "1")
    args = FP8_BASE + DELAYED_FP8
    assert run(args + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    assert "FP8: emulated on the CPU" in capsys.readouterr().out
    ref = curves(f"{tmp_path}/ref.jsonl")
    assert sorted(ref) == list(range(1, 11)) and ref[10][0] < ref[1][0] - 1.0  # it learns
    runs = torchrun_by_size(
        {
            name: (nproc, args + extra.split() + ["--metrics-file", f"{tmp_path}/{name}.jsonl"])
            for name, (nproc, extra, _) in FP8_LAYOUTS.items()
        }
    )
    for name, (_, _, linears) in FP8_LAYOUTS.items():
        assert f"for {linears} QKV/proj/fc1/fc2 linears" in runs[name].stdout, name
        got = curves(f"{tmp_path}/{name}.jsonl")
        assert sorted(got) == sorted(ref), name
        for it, (loss, gnorm) in ref.items():
            assert got[it][0] == pytest.approx(loss, rel=1e-2), (name, it)
            assert got[it][1] == pytest.approx(gnorm, rel=0.3), (name, it)


@pytest.mark.slow
def test_fp8_resume_continues_the_amax_histories(tmp_path, monkeypatch, capsys):
    """Delayed FP8 (emulated on the CPU): the checkpoint holds the amax histories, so 3 + 3 steps
    give the 6 straight steps' losses exactly (re-learning them would change the scales of step 4);
    a checkpoint saved without FP8 resumes an FP8 run with a line saying the histories restart."""
    monkeypatch.setenv("MEGATRON_FP8_EMULATE", "1")
    base = " ".join(FP8_BASE).replace("--train-iters 10", "--train-iters 6").split()
    fp8 = base + DELAYED_FP8
    assert run(fp8 + f"--metrics-file {tmp_path}/straight.jsonl".split()) == 0
    ck = f"{tmp_path}/ck"
    assert (
        run(
            fp8 + f"--save {ck} --save-interval 3 --exit-interval 3 --metrics-file {tmp_path}/r.jsonl".split()
        )
        == 0
    )
    capsys.readouterr()
    assert run(fp8 + f"--load {ck} --metrics-file {tmp_path}/r.jsonl".split()) == 0
    assert "FP8 amax histories" not in capsys.readouterr().out
    straight, resumed = curves(f"{tmp_path}/straight.jsonl"), curves(f"{tmp_path}/r.jsonl")
    assert sorted(resumed) == list(range(1, 7)) and resumed == straight
    # bf16 checkpoint, FP8 resume
    ck2 = f"{tmp_path}/ck2"
    assert run(base + f"--save {ck2} --save-interval 3 --exit-interval 3".split()) == 0
    capsys.readouterr()
    assert run(fp8 + f"--load {ck2}".split()) == 0
    assert "FP8 amax histories: not in the checkpoint" in capsys.readouterr().out
