"""init_param_rows_: any row range of a parameter's tensor-parallel shard, generated on its own, is
bitwise the same rows as init_param_ writes for the whole shard (every recipe kind: constant, unsplit,
row split, strided row split, column split; ranges across block boundaries, empty and one-row ones)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel import init as init_module
from megatron.core.tensor_parallel.init import ROWS_PER_BLOCK, init_param_, init_param_rows_, set_init_attrs

# (local shape, std, partition_dim, partition_size, partition_stride)
RECIPES = {
    "constant": ((300, 8), 0.0, -1, 1, 1),
    "unsplit": ((2 * ROWS_PER_BLOCK + 37, 8), 0.02, -1, 1, 1),
    "unsplit_1d": ((ROWS_PER_BLOCK + 3,), 0.5, -1, 1, 1),
    "rows": ((ROWS_PER_BLOCK + 44, 6), 0.02, 0, 3, 1),
    "rows_1d": ((130,), 0.1, 0, 2, 1),
    "rows_strided": ((2 * 150, 6), 0.02, 0, 3, 2),  # SwiGLU fc1: [gate; up], each half split
    "columns": ((2 * ROWS_PER_BLOCK + 5, 7), 0.3, 1, 4, 1),
}
RANGES = [(0, 1), (0, 37), (5, ROWS_PER_BLOCK + 9), (140, 160), (149, 151), (17, 17)]


def _param(recipe: tuple, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    shape, std, dim, parts, stride = recipe
    return set_init_attrs(
        torch.empty(shape, dtype=dtype, device=device),
        std=std,
        value=1.0,
        partition_dim=dim,
        partition_size=parts,
        partition_stride=stride,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_rows_equal_rows_of_whole_shard(kind: str, dtype: torch.dtype) -> None:
    recipe = RECIPES[kind]
    rows = recipe[0][0]
    for tp_rank in range(recipe[3]):
        whole = _param(recipe, dtype)
        init_param_(whole, "decoder.layers.3.w", seed=11, tp_rank=tp_rank)
        meta = _param(recipe, dtype, "meta")  # only the recipe and shape are read
        for start, stop in [*(r for r in RANGES if r[1] <= rows), (rows - 3, rows), (0, rows)]:
            dest = torch.full((stop - start, *recipe[0][1:]), float("nan"), dtype=dtype)
            init_param_rows_(dest, meta, "decoder.layers.3.w", 11, tp_rank, start, stop)
            assert torch.equal(_bits(dest), _bits(whole[start:stop])), (kind, tp_rank, start, stop)


def test_data_parallel_chunks_tile_the_shard() -> None:
    """FSDP2's dim-0 chunks (ceil(rows/dp) rows each, the last ones shorter or empty) put together are
    the shard; a different seed or name gives other values."""
    recipe = RECIPES["rows_strided"]
    whole = _param(recipe, torch.float32)
    init_param_(whole, "w", seed=1, tp_rank=2)
    rows, dp = recipe[0][0], 7
    chunk = -(-rows // dp)
    parts = []
    for r in range(dp):
        start, stop = min(r * chunk, rows), min((r + 1) * chunk, rows)
        dest = torch.empty(stop - start, *recipe[0][1:])
        init_param_rows_(dest, whole, "w", 1, 2, start, stop)
        parts.append(dest)
    assert torch.equal(torch.cat(parts), whole)
    other = torch.empty(10, *recipe[0][1:])
    init_param_rows_(other, whole, "w", 2, 2, 0, 10)
    assert not torch.equal(other, whole[:10])
    init_param_rows_(other, whole, "v", 1, 2, 0, 10)
    assert not torch.equal(other, whole[:10])


def test_only_the_overlapping_row_blocks_are_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows [300, 310) of a 3-block tensor come from block 1 alone; a strided split's rows from the
    blocks of each half's logical rows only."""
    blocks: list[int] = []
    real = init_module.stable_seed

    def spy(seed: int, name: str, block: int = 0) -> int:
        blocks.append(block)
        return real(seed, name, block)

    monkeypatch.setattr(init_module, "stable_seed", spy)
    plain = _param(((3 * ROWS_PER_BLOCK, 4), 0.02, -1, 1, 1), torch.float32, "meta")
    init_param_rows_(torch.empty(10, 4), plain, "w", 1, 0, 300, 310)
    assert blocks == [1]
    blocks.clear()
    # [gate; up] of 2 x 512 logical rows split over tp 2: tp rank 1's local rows 0..9 are logical rows
    # 256..265 (gate, block 1), its local rows 256..265 are logical rows 768..777 (up, block 3).
    strided = _param(((2 * ROWS_PER_BLOCK, 4), 0.02, 0, 2, 2), torch.float32, "meta")
    init_param_rows_(torch.empty(10, 4), strided, "w", 1, 1, 0, 10)
    init_param_rows_(torch.empty(10, 4), strided, "w", 1, 1, 256, 266)
    assert blocks == [1, 3]


def _logical(name: str, seed: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The logical tensor as the module docstring defines it: row blocks of randn * std, each block
    from a generator seeded by (seed, name, block)."""
    blocks = []
    for block, b0 in enumerate(range(0, shape[0], ROWS_PER_BLOCK)):
        gen = torch.Generator().manual_seed(init_module.stable_seed(seed, name, block))
        blocks.append(torch.randn((min(ROWS_PER_BLOCK, shape[0] - b0), *shape[1:]), generator=gen) * std)
    return torch.cat(blocks)


@pytest.mark.parametrize("kind", ["unsplit", "rows", "rows_strided", "columns"])
def test_shards_are_slices_of_the_logical_tensor(kind: str) -> None:
    shape, std, dim, parts, stride = RECIPES[kind]
    full_shape = list(shape)
    if dim >= 0:
        full_shape[dim] *= parts
    logical = _logical("w", 4, tuple(full_shape), std).to(torch.bfloat16)
    for tp_rank in range(parts):
        shard = _param(RECIPES[kind], torch.bfloat16)
        init_param_(shard, "w", seed=4, tp_rank=tp_rank)
        if dim < 0:
            expected = logical
        elif dim == 0:
            sub = shape[0] // stride
            expected = logical.view(stride, -1, *shape[1:]).narrow(1, tp_rank * sub, sub).reshape(shape)
        else:
            expected = logical.narrow(dim, tp_rank * shape[dim], shape[dim])
        assert torch.equal(_bits(shard), _bits(expected)), (kind, tp_rank)
