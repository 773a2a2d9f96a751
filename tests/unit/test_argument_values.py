"""Issue 23: bad flag values reach the check that names them (negative numbers, a run of 0 steps)."""

import pytest

from megatron.training.arguments import attach_negative_values, parse_run_config
from megatron.training.cli import run

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--mock-data --vocab-size 128 --num-workers 0"
).split()
RUN = MODEL + "--lr 1e-3 --train-iters 2".split()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--lr", "-1e-3", "--lr must be >= 0, got -0.001"),
        ("--min-lr", "-1E-3", "--min-lr must be >= 0, got -0.001"),
        ("--weight-decay", "-.5e1", "--weight-decay must be >= 0, got -5.0"),
        ("--lr", "-inf", "--lr must be >= 0, got -inf"),
    ],
)
def test_a_negative_number_is_the_flags_value_and_its_check_names_it(flag, value, message):
    """argparse read -1e-3 as a flag and said 'expected one argument'."""
    with pytest.raises(ValueError, match="^" + message):
        parse_run_config(RUN + [flag, value])


@pytest.mark.parametrize("split", ["-1,50,50", "100,-1,1", "90, -5, 15"])
def test_a_negative_split_share_is_refused(split, capsys):
    """The dataset reads any separator, so -1,50,50 used to train on 1,50,50."""
    assert run(RUN + ["--split", split]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"pretrain_gpt.py: error: --split {split}: a share is negative; give non-negative proportions "
        "of train, validation and test, e.g. --split 969,30,1"
    ]


def test_splits_megatron_takes_are_still_taken():
    for split in ("969,30,1", "98/2", "90-5-5", "100,0,0"):
        assert parse_run_config(RUN + ["--split", split]).data.split == split


def test_flags_of_several_values_and_switches_keep_their_values():
    arity = {
        "--lr": None,
        "--data-path": "*",
        "--profile-ranks": "+",
        "--bf16": 0,
        "--rampup-batch-size": "*",
        "--pair": 2,
    }
    assert attach_negative_values(["--lr", "-1e-3", "--bf16"], arity) == ["--lr=-1e-3", "--bf16"]
    # Several values: '=' would give the flag only one, so the number is respelled (the same number).
    assert attach_negative_values(["--data-path", "-1e-3", "a", "0.5", "b"], arity) == [
        "--data-path",
        "-0.001",
        "a",
        "0.5",
        "b",
    ]
    assert attach_negative_values(["--pair", "1", "-2e0", "-3"], arity) == ["--pair", "1", "-2", "-3"]
    assert attach_negative_values(["--profile-ranks", "0", "1", "--lr", "3e-4"], arity) == [
        "--profile-ranks",
        "0",
        "1",
        "--lr",
        "3e-4",
    ]
    # After a switch, past a flag's last value or after an unknown flag: left for the parser to report.
    for argv in (["--bf16", "-1e-3"], ["--lr", "1", "-2e-3"], ["--nope", "-1e-3"], ["--lr=1", "-2e-3"]):
        assert attach_negative_values(argv, arity) == argv
    assert attach_negative_values(["--split", "-1,50,50"], {"--split": None}) == ["--split=-1,50,50"]


def test_negative_values_of_lists_and_megatron_flags_parse():
    cfg = parse_run_config(
        RUN
        + "--rampup-batch-size 2 2 8 --global-batch-size 4 --profile-ranks 0 1 --one-logger-project -1e-3 "
        "--recompute-modules core_attn".split()
    )
    assert cfg.training.rampup_batch_size == [2, 2, 8] and cfg.logger.profile_ranks == [0, 1]
    assert any("--one-logger-project -1e-3" in n for n in cfg.notes)
    with pytest.raises(ValueError, match="^--rampup-batch-size -2 2 8: the start and increment must be > 0"):
        parse_run_config(RUN + "--rampup-batch-size -2e0 2 8 --global-batch-size 4".split())


def test_a_negative_number_after_a_switch_is_a_stray_value(capsys):
    with pytest.raises(SystemExit) as e:
        parse_run_config(RUN + ["--bf16", "-1e-3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "pretrain_gpt.py: error: -1e-3: unexpected value (pretrain_gpt.py takes flags only) (see --help)"
    )


def test_a_run_of_no_step_is_refused_naming_its_length_flag(capsys):
    """--train-iters 0 blamed --lr-decay-iters, a flag the user never gave."""
    assert run(MODEL + "--lr 1e-3 --train-iters 0".split()) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "pretrain_gpt.py: error: --train-iters 0 trains nothing; give 1 or more (e.g. --train-iters 1000); "
        "to evaluate a checkpoint without training, keep the run's length and add --skip-train --load DIR"
    )
    for argv, start in (
        (
            ["--train-samples", "3", "--global-batch-size", "4"],
            "^--train-samples 3 is less than the first step's global batch of 4 samples",
        ),
        (["--train-iters", "0", "--lr-decay-iters", "5"], "^--train-iters 0 trains nothing"),
        (["--train-iters", "0", "--skip-train"], "^--train-iters 0 trains nothing.*--skip-train still"),
    ):
        with pytest.raises(ValueError, match=start):
            parse_run_config(MODEL + ["--lr", "1e-3"] + argv)
    assert (
        parse_run_config(
            MODEL + "--lr 1e-3 --train-samples 4 --global-batch-size 4".split()
        ).training.train_samples
        == 4
    )
