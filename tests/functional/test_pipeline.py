"""Pipeline parallelism through pretrain_gpt.py: every pipeline layout trains the one-process model.

Same seed, same data, dropout off: per-step losses, grad norms and validation losses of pp2, pp4,
pp2 x vpp2, tp2 x pp2 and pp2 x dp2 match the single-process run to tight fp32 tolerance, with tied
(GPT) and untied (Llama-style) embeddings. A pp2 run saved half-way resumes (under pp2 and under
pp1) onto the uninterrupted curve. Bad layouts stop with their message before training.
"""

import os

import pytest
from launch import metrics, torchrun, torchrun_by_size, torchrun_many

from megatron.training.cli import run

MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --mock-data --vocab-size 256 "
    "--num-workers 0 --log-interval 1 --eval-iters 1 --eval-interval 5 --hidden-dropout 0 "
    "--attention-dropout 0 --train-iters 10"
).split()
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights".split()
)

LAYOUTS = {
    "pp2": (2, "--pipeline-model-parallel-size 2"),
    "pp2-vpp2": (2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"),
    "tp2xpp2": (4, "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"),
    "pp4": (4, "--pipeline-model-parallel-size 4"),
    "pp2xdp2": (4, "--pipeline-model-parallel-size 2 --overlap-grad-reduce"),
    # Tied embeddings across stages: both stages' copies must be owned by the same DP rank.
    "pp2xdp2-distopt": (
        4,
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce",
    ),
    "pp2-uneven": (2, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1"),
}
UNTIED = ("pp2", "pp2-vpp2", "tp2xpp2")


def records(path: str) -> tuple[dict[int, tuple[float, float]], dict[int, float]]:
    """(iteration -> (lm loss, grad norm), iteration -> validation lm loss) from a metrics file."""
    train = {it: (r["lm loss"], r["grad-norm"]) for it, r in metrics(path, "lm loss").items()}
    valid = {it: r["lm loss validation"] for it, r in metrics(path, "lm loss validation").items()}
    return train, valid


def assert_same(got, ref, name: str, iters=None) -> None:
    (g_train, g_valid), (r_train, r_valid) = got, ref
    iters = sorted(r_train) if iters is None else iters
    assert sorted(g_train) == iters, name
    for it in iters:
        assert g_train[it][0] == pytest.approx(r_train[it][0], rel=2e-5, abs=1e-6), (name, it)
        assert g_train[it][1] == pytest.approx(r_train[it][1], rel=1e-4, abs=1e-6), (name, it)
    for it, loss in g_valid.items():
        assert loss == pytest.approx(r_valid[it], rel=2e-5, abs=1e-6), (name, "validation", it)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tied", "untied"])
def test_pipeline_layouts_match_single_process(tmp_path, arch):
    base = MODEL + (LLAMA if arch == "untied" else [])
    assert run(base + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    ref = records(f"{tmp_path}/ref.jsonl")
    assert sorted(ref[0]) == list(range(1, 11)) and sorted(ref[1]) == [5, 10]
    layouts = {
        name: (nproc, base + extra.split() + ["--metrics-file", f"{tmp_path}/{name}.jsonl"])
        for name, (nproc, extra) in LAYOUTS.items()
        if arch == "tied" or name in UNTIED
    }
    torchrun_by_size(layouts)
    for name in layouts:
        got = records(f"{tmp_path}/{name}.jsonl")
        assert sorted(got[1]) == [5, 10], name
        assert_same(got, ref, name)


@pytest.mark.slow
def test_pipeline_checkpoint_resume(tmp_path):
    """pp2 for 10 steps straight == pp2 for 5, save, resume for 5 (under pp2, and under pp1)."""
    pp2 = "--pipeline-model-parallel-size 2".split()
    base = MODEL + ["--eval-iters", "0"]
    ckpt = f"{tmp_path}/ckpt"
    torchrun_many(
        2,
        [
            base + pp2 + ["--metrics-file", f"{tmp_path}/straight.jsonl"],
            base + pp2 + ["--save", ckpt, "--exit-interval", "5", "--metrics-file", f"{tmp_path}/a.jsonl"],
            base + pp2 + ["--load", ckpt, "--metrics-file", f"{tmp_path}/b.jsonl"],
        ],
    )
    straight = records(f"{tmp_path}/straight.jsonl")
    assert_same(records(f"{tmp_path}/b.jsonl"), straight, "resume pp2", iters=list(range(6, 11)))
    assert run(base + ["--load", ckpt, "--metrics-file", f"{tmp_path}/c.jsonl"]) == 0
    assert_same(records(f"{tmp_path}/c.jsonl"), straight, "resume pp1", iters=list(range(6, 11)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tied", "untied"])
def test_layout_string_with_uneven_virtual_stages_matches_single_process(tmp_path, arch):
    """--pipeline-model-parallel-layout: 6 layers as 1 / 2 / 1 / 2 over pp2 x 2 virtual stages (chunks of
    different sizes on each rank, which the even-split flags cannot express) train the one-process model."""
    base = MODEL + (LLAMA if arch == "untied" else []) + ["--num-layers", "6"]
    assert run(base + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    torchrun(
        2,
        base
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-model-parallel-layout",
            "Et|tt|t|ttL",
            "--metrics-file",
            f"{tmp_path}/layout.jsonl",
        ],
    )
    assert_same(records(f"{tmp_path}/layout.jsonl"), records(f"{tmp_path}/ref.jsonl"), "layout string")


@pytest.mark.slow
def test_embedding_and_loss_counted_in_the_split_match_single_process(tmp_path):
    """--account-for-embedding/loss-in-pipeline-split: 6 layers + 2 counted over pp2 x 2 virtual stages build
    1 / 2 / 2 / 1 layers (rank 0's first chunk and rank 1's last chunk one short), tied embedding."""
    base = MODEL + ["--num-layers", "6"]
    assert run(base + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    res = torchrun(
        2,
        base
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--metrics-file",
            f"{tmp_path}/pp.jsonl",
        ],
    )
    for line in (
        "pp rank 0 chunk 0 (virtual stage 0): layers 1-1 (1)",
        "pp rank 1 chunk 0 (virtual stage 1): layers 2-3 (2)",
        "pp rank 0 chunk 1 (virtual stage 2): layers 4-5 (2)",
        "pp rank 1 chunk 1 (virtual stage 3): layers 6-6 (1)",
    ):
        assert line in res.stdout, res.stdout[-3000:]
    assert_same(records(f"{tmp_path}/pp.jsonl"), records(f"{tmp_path}/ref.jsonl"), "accounted split")


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--pipeline-model-parallel-size 3", "is not divisible into 3 non-empty stages"),
        (
            "--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split",
            "--num-layers 4 + 1 (counted as layers) = 5 does not split into 2 stages",
        ),
        (
            "--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split --decoder-first-pipeline-num-layers 2",
            "apply to the even split only",
        ),
        ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4", "layer-to-stage table"),
        (
            "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --global-batch-size 2",
            "raise --global-batch-size",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
            "--num-layers-per-virtual-pipeline-stage 3 does not divide",
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttL --decoder-first-pipeline-num-layers 2",
            "--pipeline-model-parallel-layout sets the whole split; drop --decoder-first-pipeline-num-layers",
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tttmL",
            "('m') is not supported",
        ),
    ],
)
def test_bad_pipeline_layouts_fail_with_message(capsys, extra, message):
    """Rejected while parsing, before any process group or model exists (world size from the env)."""
    os.environ["WORLD_SIZE"] = "2" if "size 2" in extra else "3"
    try:
        assert run(MODEL + extra.split()) == 2
    finally:
        os.environ.pop("WORLD_SIZE")
    assert message in capsys.readouterr().err
