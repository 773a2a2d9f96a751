"""--pipeline-model-parallel-layout: Megatron's layout strings to layer counts per virtual stage.

The library's errors name the config parameters (``pipeline_model_parallel_layout``) and list them;
the command line shows them as flags (``user_errors.flag_message``), which these tests read.
"""

import pytest

from megatron.core.config_utils import ConfigError
from megatron.core.pipeline_parallel.layout import build_pipeline_layout, parse_layout
from megatron.training.user_errors import flag_message


def test_repetitions_commas_and_virtual_stages():
    layout = parse_layout("Et*3|(t*4|)*2,t*3L", num_layers=14, pp=2)
    assert (layout.vpp, layout.counts) == (2, (3, 4, 4, 3))
    # Virtual order: stage c * pp + r is chunk c of rank r, so rank 0 holds layers 1-3 and 8-11.
    assert [(layout.num_layers_of(r, c), layout.offset_of(r, c)) for c in range(2) for r in range(2)] == [
        (3, 0),
        (4, 3),
        (4, 7),
        (3, 11),
    ]
    # Chunks of different sizes, which the even-split flags cannot express.
    assert parse_layout("Et|tt|t|ttL", 6, 2).counts == (1, 2, 1, 2)
    assert build_pipeline_layout(32, 4, layout="Et*9|t*9|t*9|t*5L").counts == (9, 9, 9, 5)
    # The same split as --decoder-first-pipeline-num-layers, without E / L markers.
    assert parse_layout("ttt|t", 4, 2) == build_pipeline_layout(4, 2, first=3)


@pytest.mark.parametrize(
    "layout, message",
    [
        ("Et|tmL", "multi-token prediction ('m') is not supported"),
        ("Et|txL", "unknown symbol(s) ['x']"),
        ("tt|Et|tL", "E belongs to the first stage and L to the last"),
        ("EtL|tt", "E belongs to the first stage and L to the last"),
        ("Et|t|ttL", "lists 3 stages; it needs a multiple of --pipeline-model-parallel-size 2"),
        ("Ett|L", "every stage needs at least one transformer layer"),
        ("Et|tL", "the stages together --num-layers 4"),
    ],
)
def test_bad_layouts_name_the_flag_and_what_is_wrong(layout, message):
    with pytest.raises(ConfigError) as err:
        parse_layout(layout, num_layers=4, pp=2)
    assert "pipeline_model_parallel_layout" in err.value.params and "--" not in str(err.value)
    text = flag_message(err.value)
    assert "--pipeline-model-parallel-layout" in text and message in text


def test_embedding_and_loss_counted_as_layers_in_the_even_split():
    """--account-for-embedding/loss-in-pipeline-split: Megatron's counts, first / last virtual stage one layer short."""
    assert build_pipeline_layout(30, 4, account_embedding=True, account_loss=True).counts == (7, 8, 8, 7)
    assert build_pipeline_layout(31, 4, account_embedding=True).counts == (7, 8, 8, 8)
    assert build_pipeline_layout(31, 4, account_loss=True).counts == (8, 8, 8, 7)
    # With virtual stages only rank 0's first chunk and the last rank's last chunk are short.
    both = build_pipeline_layout(14, 2, 2, account_embedding=True, account_loss=True)
    assert both == parse_layout("Et*3|t*4|t*4|t*3L", 14, 2)
    assert [(both.num_layers_of(r, c), both.offset_of(r, c)) for c in range(2) for r in range(2)] == [
        (3, 0),
        (4, 3),
        (4, 7),
        (3, 11),
    ]
    # One pipeline rank: the single stage builds every layer.
    assert build_pipeline_layout(5, 1, account_embedding=True, account_loss=True).counts == (5,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_layers=32, pp=4, account_embedding=True, account_loss=True),
            "= 34 does not split into 4 stages",
        ),
        (dict(num_layers=2, pp=2, vpp=2, account_loss=True), "does not split into 4 stages"),
        (
            dict(num_layers=2, pp=4, account_embedding=True, account_loss=True),
            "with a transformer layer in each",
        ),
        (dict(num_layers=8, pp=2, first=3, account_loss=True), "drop one of them"),
        (
            dict(num_layers=8, pp=2, layout="Et*4|t*4L", account_embedding=True),
            "--pipeline-model-parallel-layout",
        ),
    ],
)
def test_bad_accounted_splits_name_the_flags(kwargs, message):
    with pytest.raises(ConfigError) as err:
        build_pipeline_layout(**kwargs)
    text = flag_message(err.value)
    assert message in text and "in-pipeline-split" in text


def test_accounted_split_suggests_a_layer_count_that_fits():
    with pytest.raises(ConfigError) as err:
        build_pipeline_layout(32, 4, account_embedding=True, account_loss=True)
    assert "use --num-layers 30" in flag_message(err.value)
    assert build_pipeline_layout(30, 4, account_embedding=True, account_loss=True)  # the suggestion works
