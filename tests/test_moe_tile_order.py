"""The grouped tile order (interpreter on the CPU): every (row tile, column block) once, group by group."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from moe.kernels.tile_order import GROUP_ROW_TILES, grouped_tile, grouped_tile_reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@triton.jit
def _walk_kernel(out_ptr, num_row_tiles, col_blocks, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < num_row_tiles * col_blocks
    position, col = grouped_tile(tl.where(mask, t, 0), num_row_tiles, col_blocks)  # kernels pass real steps only
    tl.store(out_ptr + 2 * t, position, mask=mask)
    tl.store(out_ptr + 2 * t + 1, col, mask=mask)


@pytest.mark.parametrize("num_row_tiles,col_blocks", [(1, 1), (3, 5), (8, 2), (19, 3), (17, 1), (40, 7)])
def test_walk_matches_reference_and_covers_every_tile_once(num_row_tiles, col_blocks):
    steps = num_row_tiles * col_blocks
    out = torch.full((steps, 2), -1, dtype=torch.int32)  # unwritten steps would show
    _walk_kernel[(triton.cdiv(steps, 16),)](out, num_row_tiles, col_blocks, BLOCK=16)
    got = [tuple(step) for step in out.tolist()]
    assert got == grouped_tile_reference(num_row_tiles, col_blocks)
    assert sorted(got) == [(r, c) for r in range(num_row_tiles) for c in range(col_blocks)]
    # a full group takes each column block across all its row tiles before the next column block
    if num_row_tiles >= GROUP_ROW_TILES.value:
        assert got[:GROUP_ROW_TILES.value] == [(r, 0) for r in range(GROUP_ROW_TILES.value)]
