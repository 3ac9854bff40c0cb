"""The tile walk shared by the kernels that push tiles to peers.

A launch covers, for every destination rank, a grid of (feature, block of rows) tiles. Tiles are numbered
destination by destination in a communication-aware order: remote ranks first, rotated by rank (rank r starts
with r+1, so ranks do not all hit one peer at once), the local rank last. Persistent programs take tiles
pid, pid + num_programs, ... so every link is busy from the start and local work fills the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class PeerTilePlan:
    dest_order: torch.Tensor  # int32 [world]: destination of the k-th group of tiles
    tile_starts: torch.Tensor  # int32 [world + 1]: first tile of the k-th group
    row_begin: torch.Tensor  # int64 [world]: rows [row_begin[d], row_end[d]) are tiled for destination d
    row_end: torch.Tensor
    feature_begin: torch.Tensor  # int32 [world]: features feature_begin[d] + [0, feature_count[d]) go to d
    num_tiles: int


def default_num_programs(device: torch.device) -> int:
    """Persistent programs: many small ones per SM keep enough gathers in flight (swept on H200)."""
    return 32 * torch.cuda.get_device_properties(device).multi_processor_count


def remote_first_order(rank: int, world_size: int) -> list[int]:
    return [(rank + k) % world_size for k in range(1, world_size + 1)]


def plan_peer_tiles(rank: int, rows: list[tuple[int, int]], features: list[tuple[int, int]], block_rows: int,
                    device: torch.device) -> PeerTilePlan:
    """rows[d] = (begin, end) and features[d] = (first, count) of destination d."""
    world = len(rows)
    order = remote_first_order(rank, world)
    starts = [0]
    for d in order:
        starts.append(starts[-1] + features[d][1] * triton.cdiv(rows[d][1] - rows[d][0], block_rows))

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return PeerTilePlan(dest_order=tensor(order, torch.int32), tile_starts=tensor(starts, torch.int32),
                        row_begin=tensor([r[0] for r in rows], torch.int64),
                        row_end=tensor([r[1] for r in rows], torch.int64),
                        feature_begin=tensor([f[0] for f in features], torch.int32), num_tiles=starts[-1])


@triton.jit
def tile_coords(t, dest_order_ptr, tile_starts_ptr, row_begin_ptr, row_end_ptr, feature_begin_ptr,
                WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Tile t -> (destination, feature, row indices [BLOCK_ROWS], row mask, first row of the destination)."""
    k_offs = tl.arange(0, WORLD_P2)
    group_ends = tl.load(tile_starts_ptr + 1 + k_offs, mask=k_offs < WORLD, other=2147483647)
    k = tl.sum((group_ends <= t).to(tl.int32), axis=0)
    dest = tl.load(dest_order_ptr + k)
    u = t - tl.load(tile_starts_ptr + k)
    begin = tl.load(row_begin_ptr + dest)
    end = tl.load(row_end_ptr + dest)
    blocks = tl.cdiv(end - begin, BLOCK_ROWS)
    feature = tl.load(feature_begin_ptr + dest) + (u // blocks).to(tl.int32)
    rows = begin + (u % blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return dest, feature, rows, rows < end, begin
