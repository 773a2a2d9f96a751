"""FSDP2 through pretrain_gpt.py: the trainer's path (model wrapping, meta-device build, schedules,
finalize_model_grads, the optimizer over local shards, checkpoints) trains the one-process model,
and FSDP2 checkpoints resume under a non-FSDP layout and back."""

from __future__ import annotations

import pytest
from launch import torchrun_many
from test_layouts import MODEL, assert_curves_match, curves

from megatron.training.cli import run

# Tied embeddings (summed over the first and last pipeline stage under pp2) and SwiGLU's stacked fc1.
ARGS = " ".join(MODEL).replace("--train-iters 10", "--train-iters 8").split() + [
    "--swiglu",
    "--normalization",
    "RMSNorm",
]
# 4 layers for pp2 x 2 virtual stages; --eod-mask-loss makes the per-token counts differ per micro-batch.
VPP = (
    " ".join(MODEL).replace("--train-iters 10", "--train-iters 3").replace("--num-layers 2", "--num-layers 4")
    + " --calculate-per-token-loss --eod-mask-loss"
).split()
# Megatron-LM's examples/megatron_fsdp flags, as given there.
MEGATRON_FSDP = (
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --init-model-with-meta-device "
    "--ckpt-format fsdp_dtensor --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
).split()


@pytest.mark.slow
def test_fsdp2_trains_the_one_process_model_and_resumes_across_layouts(tmp_path):
    """8 steps of the one-process run, as three runs of one 4-process launch sharing a checkpoint
    directory (and a fourth run, below): 1-3 tp2 x FSDP2 dp2 (sequence parallel, full recompute, meta-device init), saved at 3;
    4-6 tp2 x dp2 without FSDP from that checkpoint, saved at 6; 7-8 pp2 x dp2 under Megatron-FSDP's
    example flags (FSDP2 ZeRO-3) from the non-FSDP checkpoint. Every step's loss and grad norm equal
    the uninterrupted one-process run's. A fourth run: FSDP2 dp2 x pp2 with two virtual stages per rank
    (the interleaved schedule, one FSDP2 root per chunk) and per-token loss on its own reference."""
    assert run(ARGS + f"--metrics-file {tmp_path}/ref.jsonl".split()) == 0
    ref = curves(f"{tmp_path}/ref.jsonl")
    assert run(VPP + f"--metrics-file {tmp_path}/vpp_ref.jsonl".split()) == 0
    ck, out = f"{tmp_path}/ck", f"{tmp_path}/runs.jsonl"
    fsdp2 = (
        "--use-torch-fsdp2 --tensor-model-parallel-size 2 --sequence-parallel --init-model-with-meta-device "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    )
    runs = torchrun_many(
        4,
        [
            ARGS + f"{fsdp2} --save {ck} --save-interval 3 --exit-interval 3 --metrics-file {out}".split(),
            ARGS
            + "--tensor-model-parallel-size 2".split()
            + f"--load {ck} --save {ck} --save-interval 3 --exit-interval 6 --metrics-file {out}".split(),
            ARGS
            + MEGATRON_FSDP
            + f"--pipeline-model-parallel-size 2 --load {ck} --metrics-file {out}".split(),
            VPP
            + "--use-torch-fsdp2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1".split()
            + f"--metrics-file {tmp_path}/vpp.jsonl".split(),
        ],
    )
    assert "runs on PyTorch FSDP2" in runs[2].stdout
    got = curves(out)
    assert sorted(got) == list(range(1, 9))
    assert_curves_match(got, ref, "fsdp2 / tp2 / pp2 x fsdp2")
    vpp_ref = curves(f"{tmp_path}/vpp_ref.jsonl")
    assert sorted(curves(f"{tmp_path}/vpp.jsonl")) == sorted(vpp_ref) == [1, 2, 3]
    assert_curves_match(curves(f"{tmp_path}/vpp.jsonl"), vpp_ref, "vpp2 x pp2 x fsdp2")


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            "--use-torch-fsdp2 --use-distributed-optimizer",
            "--use-distributed-optimizer with --use-torch-fsdp2: FSDP2 already shards the optimizer state "
            "over the data-parallel ranks; drop --use-distributed-optimizer",
        ),
        (
            "--use-torch-fsdp2 --log-params-norm",
            "--log-params-norm with --use-torch-fsdp2 is not built (the norm of dp-sharded parameters); "
            "drop --log-params-norm",
        ),
        (
            "--use-megatron-fsdp --log-params-norm",
            "--log-params-norm with --use-megatron-fsdp is not built (the norm of dp-sharded parameters); "
            "drop --log-params-norm",
        ),
    ],
)
def test_combinations_fsdp2_cannot_compose_with_are_refused_in_one_line(capsys, extra, message):
    assert run(ARGS + extra.split()) == 2
    assert capsys.readouterr().err.strip() == f"pretrain_gpt.py: error: {message}"


def test_fsdp2_refuses_delayed_fp8_scaling_in_one_line():
    """Checked on the config (FP8 itself needs a GPU, which the parse-time check asks for first)."""
    from types import SimpleNamespace

    from megatron.core.config_utils import ConfigError
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.training.validation import check_fsdp

    cfg = SimpleNamespace(
        ddp=DistributedDataParallelConfig(use_torch_fsdp2=True),
        model=SimpleNamespace(fp8_format="e4m3", fp8_recipe="delayed"),
        logger=SimpleNamespace(log_params_norm=False),
    )
    with pytest.raises(ConfigError, match="^--fp8-recipe delayed .* with --use-torch-fsdp2 is not built"):
        check_fsdp(cfg)
    cfg.model.fp8_recipe = "tensorwise"
    check_fsdp(cfg)
