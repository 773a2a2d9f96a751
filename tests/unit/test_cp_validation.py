"""The context-parallel checks of megatron/training/validation.py, one test per mistake: each is a
``ConfigError`` from ``parse_run_config`` naming the flag, and through the entry point
(``cli.run``) one line on stderr and exit code 2. No process is spawned: the world size is the
launcher's ``WORLD_SIZE``."""

from __future__ import annotations

import re

import pytest

from megatron.core.config_utils import ConfigError
from megatron.training import cli
from megatron.training.arguments import parse_run_config

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
).split()

# (world size, flags, what the one line says: a regex naming the flag and the way out)
MISTAKES = {
    "seq length not divisible by 2 x cp": (
        2,
        "--context-parallel-size 2 --attention-dropout 0 --seq-length 30 --max-position-embeddings 32",
        r"--seq-length 30 does not split into 2 x --context-parallel-size 2 = 4 equal chunks; "
        r"use a multiple of 4 \(e.g. --seq-length 32\)",
    ),
    "world size not divisible by tp x pp x cp": (
        3,
        "--context-parallel-size 2 --attention-dropout 0",
        r"world size 3 is not divisible by .*--context-parallel-size 2",
    ),
    "unknown comm type": (
        2,
        "--context-parallel-size 2 --attention-dropout 0 --cp-comm-type ring",
        r"--cp-comm-type ring: not one of p2p, a2a, allgather, a2a\+p2p",
    ),
    "comm types neither one nor one per layer": (
        2,
        "--context-parallel-size 2 --attention-dropout 0 --cp-comm-type p2p a2a p2p",
        r"--cp-comm-type has 3 values; .*one per layer \(--num-layers 2 values\)",
    ),
    "a2a with heads not divisible by cp": (
        4,
        "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a "
        "--group-query-attention --num-query-groups 2",
        r"--cp-comm-type a2a splits the attention heads over --context-parallel-size 4: .*"
        r"must be divisible by 4; use --cp-comm-type p2p",
    ),
    "a2a+p2p without hierarchical sizes": (
        4,
        "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p",
        r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A P .*"
        r"--hierarchical-context-parallel-sizes 2 2",
    ),
    "hierarchical sizes whose product is not cp": (
        4,
        "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes 2 3",
        r"--hierarchical-context-parallel-sizes 2 3: give two sizes .* whose product is "
        r"--context-parallel-size 4, e.g. --hierarchical-context-parallel-sizes 2 2",
    ),
    "three hierarchical sizes": (
        4,
        "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes 2 1 2",
        r"--hierarchical-context-parallel-sizes 2 1 2: give two sizes",
    ),
    "a2a+p2p with heads not divisible by the a2a level": (
        4,
        "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes 4 1 --group-query-attention --num-query-groups 2",
        r"--cp-comm-type a2a\+p2p splits the attention heads over the a2a level 4 of "
        r"--hierarchical-context-parallel-sizes",
    ),
    "attention dropout": (
        2,
        "--context-parallel-size 2 --attention-dropout 0.1",
        r"--attention-dropout 0.1 with --context-parallel-size 2: .*pass --attention-dropout 0",
    ),
}


@pytest.fixture
def world(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # no torchrun store to meet in
    monkeypatch.delenv("RANK", raising=False)

    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))

    return set_world


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_cp_mistake_is_one_line_naming_the_flag(name, world, capsys):
    size, flags, says = MISTAKES[name]
    world(size)
    with pytest.raises(ConfigError, match=says):
        parse_run_config(BASE + flags.split())
    assert cli.run(BASE + flags.split()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: ")
    assert re.search(says, err[0]), err[0]


def test_valid_cp_layouts_are_taken(world):
    """The mistakes' nearest valid neighbours pass (each check refuses only its own mistake)."""
    for size, flags in (
        (2, "--context-parallel-size 2 --attention-dropout 0"),
        (4, "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a"),
        (2, "--context-parallel-size 2 --attention-dropout 0 --cp-comm-type allgather a2a"),
        (
            4,
            "--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
            "--hierarchical-context-parallel-sizes 2 2 --group-query-attention --num-query-groups 2",
        ),
    ):
        world(size)
        assert parse_run_config(BASE + flags.split()).model.context_parallel_size == size


def test_hierarchical_sizes_without_a2a_p2p_are_a_note(world):
    world(4)
    cfg = parse_run_config(
        BASE
        + "--context-parallel-size 4 --attention-dropout 0 --hierarchical-context-parallel-sizes 2 2".split()
    )
    assert any("--hierarchical-context-parallel-sizes has no effect" in note for note in cfg.notes)
