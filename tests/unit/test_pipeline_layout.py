"""--pipeline-model-parallel-layout: Megatron's layout strings to layer counts per virtual stage."""

import pytest

from megatron.core.pipeline_parallel.layout import build_pipeline_layout, parse_layout


def test_repetitions_commas_and_virtual_stages():
    layout = parse_layout("Et*3|(t*4|)*2,t*3L", num_layers=14, pp=2)
    assert (layout.vpp, layout.counts) == (2, (3, 4, 4, 3))
    # Virtual order: stage c * pp + r is chunk c of rank r, so rank 0 holds layers 1-3 and 8-11.
    assert [(layout.num_layers_of(r, c), layout.offset_of(r, c)) for c in range(2) for r in range(2)] == \
        [(3, 0), (4, 3), (4, 7), (3, 11)]
    # Chunks of different sizes, which the even-split flags cannot express.
    assert parse_layout("Et|tt|t|ttL", 6, 2).counts == (1, 2, 1, 2)
    assert build_pipeline_layout(32, 4, layout="Et*9|t*9|t*9|t*5L").counts == (9, 9, 9, 5)
    # The same split as --decoder-first-pipeline-num-layers, without E / L markers.
    assert parse_layout("ttt|t", 4, 2) == build_pipeline_layout(4, 2, first=3)


@pytest.mark.parametrize("layout, message", [
    ("Et|tmL", "multi-token prediction ('m') is not supported"),
    ("Et|txL", "unknown symbol(s) ['x']"),
    ("tt|Et|tL", "E belongs to the first stage and L to the last"),
    ("EtL|tt", "E belongs to the first stage and L to the last"),
    ("Et|t|ttL", "lists 3 stages; it needs a multiple of --pipeline-model-parallel-size 2"),
    ("Ett|L", "every stage needs at least one transformer layer"),
    ("Et|tL", "the stages together --num-layers 4"),
])
def test_bad_layouts_name_the_flag_and_what_is_wrong(layout, message):
    with pytest.raises(ValueError) as err:
        parse_layout(layout, num_layers=4, pp=2)
    assert "--pipeline-model-parallel-layout" in str(err.value) and message in str(err.value)
