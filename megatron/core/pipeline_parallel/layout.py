"""Which transformer layers each pipeline stage (and virtual chunk) builds.

Global layer order follows the virtual stage index ``c * pp + r`` (Megatron's rule): chunk ``c`` on
pipeline rank ``r`` is virtual stage ``c * pp + r``. Example: 16 layers, pp 4, vpp 2 gives rank 0
layers 1-2 (chunk 0) and 9-10 (chunk 1).

Uneven splits: ``first`` / ``last`` layers go to the first / last pipeline rank (split evenly over
that rank's virtual chunks); the remaining layers are split evenly over the other ranks' chunks.
A split that drops or duplicates a layer, or leaves a stage empty, raises ``ConfigError`` with the
layer-to-stage table it would have produced.

Megatron's ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` count
the embedding / the output layer and loss as one layer each in the even split: ``num_layers`` plus one
for each must divide into ``pp x vpp`` equal stages, and the first / last virtual stage then builds one
transformer layer fewer. Example: 30 layers, pp 4, both flags: 32 slots, ranks build 7/8/8/7 layers.

Any split, virtual chunks of different sizes included: ``--pipeline-model-parallel-layout`` (Megatron's
syntax), one string listing every virtual stage in that order, separated by ``|``: ``t`` a transformer
layer, ``E`` the embedding (first stage only), ``L`` the output layer and loss (last stage only);
``x*n`` and ``(...)*n`` repeat, commas are cosmetic. ``"Et*3|(t*4|)*2,t*3L"`` splits 14 layers over
four stages as 3/4/4/3; the number of stages over ``pp`` is the virtual stages per rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron.core.config_utils import ConfigError

# The parameters (TransformerConfig fields) the split is made of, as the errors name them.
PARAMS = (
    "num_layers",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _error(message: str) -> ConfigError:
    """A ConfigError listing the parameters ``message`` names."""
    return ConfigError(
        message, params=tuple(p for p in PARAMS if re.search(rf"(?<![\w-]){p}(?![\w-])", message))
    )


@dataclass(frozen=True)
class PipelineLayout:
    """Layer counts per virtual stage; ``counts[c * pp + r]`` is chunk ``c`` of pipeline rank ``r``."""

    num_layers: int
    pp: int
    vpp: int
    counts: tuple[int, ...]

    def num_layers_of(self, pp_rank: int, chunk: int = 0) -> int:
        """Number of layers chunk ``chunk`` of pipeline rank ``pp_rank`` builds."""
        return self.counts[chunk * self.pp + pp_rank]

    def offset_of(self, pp_rank: int, chunk: int = 0) -> int:
        """0-based global index of the chunk's first layer (layers before it in virtual-stage order)."""
        return sum(self.counts[: chunk * self.pp + pp_rank])

    def table(self) -> str:
        """Human-readable layer-to-stage table (1-based layer numbers, as in the logs)."""
        lines = [
            f"layer-to-stage table (num_layers {self.num_layers}, pipeline_model_parallel_size "
            f"{self.pp}, virtual stages per rank {self.vpp}):"
        ]
        start = 0
        for v, n in enumerate(self.counts):
            c, r = divmod(v, self.pp)
            span = f"layers {start + 1}-{start + n}" if n > 0 else "no layers"
            lines.append(f"  pp rank {r} chunk {c} (virtual stage {v}): {span} ({n})")
            start += n
        if start < self.num_layers:
            lines.append(f"  unassigned: layers {start + 1}-{self.num_layers}")
        elif start > self.num_layers:
            lines.append(f"  {start - self.num_layers} layer(s) beyond num_layers {self.num_layers}")
        return "\n".join(lines)


LAYOUT_PARAM = "pipeline_model_parallel_layout"


def parse_layout(layout: str, num_layers: int, pp: int) -> PipelineLayout:
    """The :class:`PipelineLayout` a ``pipeline_model_parallel_layout`` string describes.

    Raises:
        ConfigError: a symbol other than t/E/L (``m``: multi-token prediction is not built), E or L
            outside the first / last stage, a stage count that is not a multiple of ``pp``, a stage
            without a transformer layer, or a layer count other than ``num_layers``.
    """
    text = layout.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = sorted(set(text) - set("tEL|"))
    if bad:
        what = "multi-token prediction ('m') is not supported" if bad == ["m"] else f"unknown symbol(s) {bad}"
        raise _error(
            f"{LAYOUT_PARAM} {layout!r}: {what}; use t (transformer layer), E (embedding, first "
            'stage) and L (output layer and loss, last stage), e.g. "Ettt|tttL"'
        )
    if "E" in "".join(stages[1:]) or "L" in "".join(stages[:-1]):
        raise _error(
            f'{LAYOUT_PARAM} {layout!r}: E belongs to the first stage and L to the last, e.g. "Ettt|tttL"'
        )
    if len(stages) % pp != 0:
        raise _error(
            f"{LAYOUT_PARAM} {layout!r} lists {len(stages)} stages; it needs a multiple of "
            f"pipeline_model_parallel_size {pp} (pp x virtual stages per rank)"
        )
    result = PipelineLayout(num_layers, pp, len(stages) // pp, tuple(stage.count("t") for stage in stages))
    if min(result.counts) == 0 or sum(result.counts) != num_layers:
        raise _error(
            f"{LAYOUT_PARAM} {layout!r}: every stage needs at least one transformer layer (t) and "
            f"the stages together num_layers {num_layers}.\n{result.table()}"
        )
    return result


def _split(total: int, parts: int) -> tuple[list[int], bool]:
    """Even split of ``total`` over ``parts`` (floor when it does not divide); True when exact."""
    if parts <= 0:
        return [], total == 0
    return [max(total, 0) // parts] * parts, total >= 0 and total % parts == 0


ACCOUNT_PARAMS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _account_split(num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool) -> PipelineLayout:
    """The even split with the embedding and / or the loss counted as a layer (Megatron's rule)."""
    flags = " and ".join(f for f, on in zip(ACCOUNT_PARAMS, (embedding, loss)) if on)
    extra = int(embedding) + int(loss)
    slots = num_layers + extra
    stages = pp * vpp
    per, rest = divmod(slots, stages)
    counts = [per] * stages
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    result = PipelineLayout(num_layers, pp, vpp, tuple(counts))
    if rest == 0 and min(counts) > 0:
        return result
    # The nearest layer count whose sum is a multiple of the stages, at least two slots a stage.
    fits = min(
        (
            n
            for n in range(1, num_layers + 2 * stages + 1)
            if (n + extra) % stages == 0 and n + extra > stages
        ),
        key=lambda n: abs(n - num_layers),
    )
    raise _error(
        f"{flags}: num_layers {num_layers} + {extra} (counted as layers) = {slots} does not split into "
        f"{stages} stages (pipeline_model_parallel_size {pp} x {vpp} virtual stages per rank) of equal size with "
        f"a transformer layer in each; use num_layers {fits} (or another count that makes the sum a multiple "
        f"of {stages}), or {LAYOUT_PARAM} for any split.\n{result.table()}"
    )


def build_pipeline_layout(
    num_layers: int,
    pp: int = 1,
    vpp: int | None = None,
    first: int | None = None,
    last: int | None = None,
    layout: str | None = None,
    account_embedding: bool = False,
    account_loss: bool = False,
) -> PipelineLayout:
    """Assign ``num_layers`` layers to ``pp`` ranks x ``vpp`` virtual chunks.

    Args:
        num_layers: ``num_layers``.
        pp: ``pipeline_model_parallel_size``.
        vpp: virtual chunks per rank (None or 1: no interleaving).
        first / last: ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``.
        layout: ``pipeline_model_parallel_layout`` (:func:`parse_layout`); replaces ``vpp``, ``first``
            and ``last``.
        account_embedding / account_loss: ``account_for_embedding_in_pipeline_split`` /
            ``account_for_loss_in_pipeline_split`` (even split only: not with ``first``, ``last``, ``layout``).

    Raises:
        ConfigError: the split does not cover every layer exactly once or leaves a stage empty; the
            message names the flags and prints the layer-to-stage table.
    """
    accounted = [f for f, on in zip(ACCOUNT_PARAMS, (account_embedding, account_loss)) if on]
    if accounted and (layout is not None or first is not None or last is not None):
        other = (
            LAYOUT_PARAM
            if layout is not None
            else "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers"
        )
        raise _error(
            f"{' / '.join(accounted)} apply to the even split only; {other} already sets the "
            f"layers of the first and last stages: drop one of them"
        )
    if layout is not None:
        return parse_layout(layout, num_layers, pp)
    vpp = vpp or 1
    if pp < 1 or vpp < 1:
        raise _error(
            f"pipeline_model_parallel_size ({pp}) and the virtual stages per rank ({vpp}) must be >= 1"
        )
    if accounted:
        return _account_split(num_layers, pp, vpp, account_embedding, account_loss)
    if pp == 1 and (first is not None or last is not None):
        raise _error(
            "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers only apply "
            "with pipeline_model_parallel_size > 1; drop them"
        )
    per_rank: list[int | None] = [None] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    fixed = sum(n for n in per_rank if n is not None)
    free = [r for r in range(pp) if per_rank[r] is None]
    even, exact = _split(num_layers - fixed, len(free))
    for r, n in zip(free, even):
        per_rank[r] = n
    counts = [0] * (pp * vpp)
    for r, layers in enumerate(per_rank):
        chunk_counts, chunk_exact = _split(layers or 0, vpp)
        exact = exact and chunk_exact
        for c, k in enumerate(chunk_counts):
            counts[c * pp + r] = k
    result = PipelineLayout(num_layers, pp, vpp, tuple(counts))
    if exact and sum(counts) == num_layers and min(counts) > 0:
        return result
    if first is None and last is None:
        what = (
            f"num_layers {num_layers} is not divisible into {pp * vpp} non-empty stages "
            f"(pipeline_model_parallel_size {pp} x {vpp} virtual stages per rank)"
        )
        fix = (
            f"use num_layers a multiple of {pp * vpp}, or set decoder_first_pipeline_num_layers / "
            "decoder_last_pipeline_num_layers"
        )
    else:
        what = (
            f"decoder_first_pipeline_num_layers {first} / decoder_last_pipeline_num_layers {last} do not "
            f"split num_layers {num_layers} into {pp * vpp} non-empty stages"
        )
        fix = (
            f"the remaining layers must divide evenly over the other {len(free)} rank(s) x {vpp} chunk(s), and "
            f"each given count must be a positive multiple of {vpp}"
        )
    raise _error(f"{what}; {fix}.\n{result.table()}")
