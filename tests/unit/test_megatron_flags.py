"""Every Megatron-LM flag is handled on purpose: implemented, accepted (always / no effect, with a
note) or refused with what to use instead; mistakes are reported together; --help is readable."""

import os

import pytest

from megatron.training.arguments import build_parser, flag_list, parse_run_config
from megatron.training.megatron_flag_table import FOREIGN
from megatron.training.megatron_flags import ALWAYS, NO_EFFECT, REFUSED

HERE = os.path.dirname(__file__)
MEGATRON_FLAGS = os.path.join(HERE, "snapshots", "megatron-flags-0.19.2.txt")
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()


def megatron_flags() -> list[str]:
    with open(MEGATRON_FLAGS) as f:
        return [line.strip() for line in f if line.startswith("--")]


def _values(entry) -> list[str]:
    """A value list that fits the entry's arity (an accepted value where there is one)."""
    value = entry.accepted[0] if entry.accepted else "1"
    n = entry.nargs
    if n == 0:
        return []
    if n in (None, "?", "+"):
        return [value]
    if n == "*":
        return []
    return [value] * n


def _errors(capsys, argv) -> list[str]:
    with pytest.raises(SystemExit) as e:
        parse_run_config(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_all_846_flags_of_megatron_lm_are_each_in_exactly_one_class():
    flags = megatron_flags()
    assert len(flags) == len(set(flags)) == 846
    implemented = set(flag_list()) | {"--help"}
    classes = {}
    for flag in flags:
        found = [
            c
            for c in ("implemented", ALWAYS, NO_EFFECT, REFUSED)
            if (c == "implemented" and flag in implemented) or (flag in FOREIGN and FOREIGN[flag].kind == c)
        ]
        classes[flag] = found
    unhandled = [f for f, c in classes.items() if len(c) != 1]
    assert not unhandled, {f: classes[f] for f in unhandled}
    counts = {
        c: sum(1 for v in classes.values() if v == [c]) for c in ("implemented", ALWAYS, NO_EFFECT, REFUSED)
    }
    assert all(counts.values()), counts
    assert not set(FOREIGN) & implemented  # no flag both implemented and listed as foreign
    assert set(FOREIGN) <= set(flags)  # the table holds Megatron-LM's flags only


def test_every_accepted_megatron_flag_parses_with_its_arity_and_leaves_a_note():
    """All accepted flags in one command line, each with a value of its arity: nothing is
    unrecognized, no value is mistaken for a flag, every flag is named in a note and nothing changes."""
    argv, accepted = list(BASE), []
    for flag, entry in FOREIGN.items():
        if entry.kind != REFUSED:
            argv += [flag, *_values(entry)]
            accepted.append(flag)
    cfg = parse_run_config(argv)
    noted = " ".join(cfg.notes)
    assert [f for f in accepted if f not in noted] == []
    assert all(n.startswith("note: ") for n in cfg.notes)
    assert cfg.to_dict() == parse_run_config(BASE).to_dict()


def test_every_refused_megatron_flag_is_refused_and_named_in_one_report(capsys):
    argv, refused = list(BASE), []
    for flag, entry in FOREIGN.items():
        if entry.kind == REFUSED:
            argv += [flag, *_values(entry)]
            refused.append(flag)
    err = "\n".join(_errors(capsys, argv))
    assert "not a flag" not in err
    assert [f for f in refused if f + " " not in err and f + ":" not in err and f + "," not in err] == []


def test_a_value_outside_the_accepted_ones_is_refused_with_what_to_pass(capsys):
    err = _errors(capsys, BASE + ["--attention-backend", "unfused"])
    assert err[0].startswith("pretrain_gpt.py: error: --attention-backend unfused: attention always runs")
    assert "pass auto or drop it" in err[0]
    assert parse_run_config(BASE + ["--main-params-dtype", "fp32"]).notes


def test_refusals_bad_values_and_unknown_flags_are_reported_together(capsys):
    err = _errors(
        capsys,
        BASE
        + [
            "--moe-enable-deepep",
            "--moe-flex-dispatcher-backend",
            "deepep",
            "--normalization",
            "Foo",
            "--hidden-size",
            "x",
            "--non-persistent-save-interval",
            "5",
            "--hiden-dropout",
            "0.1",
        ],
    )
    assert err[0].startswith("pretrain_gpt.py: error: 5 problems with the flags (see --help;")
    body = "\n".join(err)
    assert (
        "--moe-enable-deepep, --moe-flex-dispatcher-backend deepep: the flex dispatcher (DeepEP" in body
    )  # one reason
    assert "--normalization Foo: choose one of LayerNorm, RMSNorm" in body
    assert "--hidden-size x: not a valid int" in body
    assert "--non-persistent-save-interval 5: non-persistent (local) checkpoints are not built" in body
    assert (
        "--hiden-dropout: not a flag of pretrain_gpt.py nor of Megatron-LM 0.19.2; did you mean --hidden-dropout?"
        in body
    )
    assert "Traceback" not in body


@pytest.mark.parametrize(
    "typo, hint",
    [
        ("--num-layer", "--num-layers"),
        ("--lr-warmup-iter", "--lr-warmup-iters"),
        ("--save-intervall", "--save-interval"),
        ("--skip-trian", "--skip-train"),
    ],
)
def test_did_you_mean_names_a_really_close_flag(capsys, typo, hint):
    err = _errors(capsys, BASE + [typo, "3"])
    assert len(err) == 1 and err[0].endswith(f"did you mean {hint}? (see --help)")


@pytest.mark.parametrize("far", ["--foo-bar", "--clip-gradients-please", "--data", "--fp"])
def test_did_you_mean_stays_quiet_for_a_flag_that_is_not_close(capsys, far):
    err = _errors(capsys, BASE + [far])
    assert len(err) == 1 and "did you mean" not in err[0] and far in err[0]


def test_accepted_flags_are_noted_once_in_the_log(capsys):
    from megatron.training.cli import run

    rc = run(
        BASE
        + [
            "--train-iters",
            "1",
            "--eval-iters",
            "0",
            "--num-workers",
            "0",
            "--manual-gc",
            "--empty-unused-memory-level",
            "1",
            "--use-mcore-models",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("--manual-gc") == 1 and out.count("--empty-unused-memory-level 1") == 1
    assert "note: --use-mcore-models: accepted, this package always does so" in out


def test_sequence_parallel_at_tensor_parallel_size_one_is_turned_off_with_a_note():
    cfg = parse_run_config(BASE + ["--sequence-parallel"])
    assert cfg.model.sequence_parallel is False
    assert any("--sequence-parallel is off" in n for n in cfg.notes)


def test_help_is_readable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert len(usage.splitlines()) <= 2  # not a block listing every flag
    assert "--help-megatron" in out
    parser = build_parser()
    from megatron.training.megatron_flags import GIVEN

    for action in parser._actions:
        if action.dest in (GIVEN, "help", "help_megatron"):
            continue
        assert "[default: " in action.help or "[required]" in action.help or "efault" in action.help, (
            action.option_strings
        )


def test_help_megatron_lists_the_refused_and_accepted_flags(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help-megatron"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Refused, with what to use instead:" in out and "Accepted with a note: no effect here:" in out
    for flag in ("--async-strategy", "--manual-gc", "--use-mcore-models", "--moe-enable-deepep"):
        assert flag in out
