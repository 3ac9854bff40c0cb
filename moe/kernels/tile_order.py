"""The order in which the MoE grouped GEMMs walk their (row tile, column block) tiles.

Row tile by row tile, the programs in flight at one time (one per SM) cover one or two row tiles and every column
block, so each row tile reads the whole [K, N] weight of its expert. Once that weight outgrows L2 (50 MB; d=4096,
ffn=14336: w13[e] is 235 MB) it streams from HBM once per row tile, and the GEMM becomes memory-bound. Grouped
order: GROUP_ROW_TILES consecutive row tiles of the walk take each column block in turn, so a weight panel read
from HBM serves the whole group from L2. The walk's own order of row tiles (remote first, local first, ...) is kept
at group granularity.
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP_ROW_TILES = tl.constexpr(8)


@triton.jit
def grouped_tile(t, num_row_tiles, col_blocks):
    """Step t of the walk -> (position of its row tile in the walk, column block). Group g holds walk positions
    [g * GROUP_ROW_TILES, ...) (the last group may be smaller); within it, positions vary fastest."""
    group_steps = GROUP_ROW_TILES * col_blocks
    first = (t // group_steps) * GROUP_ROW_TILES
    size = tl.minimum(num_row_tiles - first, GROUP_ROW_TILES)
    within = t % group_steps
    return first + within % size, within // size


def grouped_tile_reference(num_row_tiles: int, col_blocks: int) -> list[tuple[int, int]]:
    """Every step's (walk position, column block), built group by group."""
    steps = []
    for first in range(0, num_row_tiles, GROUP_ROW_TILES.value):
        group = range(first, min(first + GROUP_ROW_TILES.value, num_row_tiles))
        steps += [(position, col) for col in range(col_blocks) for position in group]
    return steps
