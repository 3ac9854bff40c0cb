"""The tile walk shared by the kernels that push tiles to peers.

A launch covers, for every destination rank, a grid of (feature, block of rows) tiles: one group of tiles per
destination. Groups are numbered in a communication-aware order: remote ranks first, rotated by rank (rank r
starts with r+1, so ranks do not all hit one peer at once), the local rank last. Persistent programs walk tiles
t, t + stride, ... in one of two ways:
- split (`local_tile_cost` a number): the programs are split among the groups in proportion to their work (tiles
  x cost of a tile), in the same order, each walking its own group: every link and the local memory are busy
  together from the first tile to the last. Right where a tile's compute, not the link, decides its time: the
  lookup took 426 µs this way against 470 µs in one walk (2 x H200, docs/benchmarks.md), which was link-bound
  while the remote tiles lasted and memory-bound after.
- one walk (`local_tile_cost=None`): every program walks the whole remote-first list (stride: all programs).
  Right for a plain copy: the gradient push took 221 µs this way against 241-251 µs split.
Consumers lose nothing either way: a program raises its flags once, after its last tile. Where not every program
is resident at once, the remote groups' programs, numbered first, start first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class PeerTilePlan:
    dest_order: torch.Tensor  # int32 [world]: destination of the k-th group of tiles
    tile_starts: torch.Tensor  # int32 [world + 1]: group k holds tiles [tile_starts[k], tile_starts[k + 1])
    # int32 [world + 1] each: programs [program_starts[w], program_starts[w + 1]) walk tiles
    # [walk_starts[w], walk_starts[w + 1]) (split: the groups; one walk: w = 0 holds every program and tile)
    program_starts: torch.Tensor
    walk_starts: torch.Tensor
    row_begin: torch.Tensor  # int64 [world]: rows [row_begin[d], row_end[d]) are tiled for destination d
    row_end: torch.Tensor
    feature_begin: torch.Tensor  # int32 [world]: features feature_begin[d] + [0, feature_count[d]) go to d
    num_programs: int


def default_num_programs(device: torch.device) -> int:
    """Persistent programs: many small ones per SM keep enough gathers in flight (swept on H200)."""
    return 32 * torch.cuda.get_device_properties(device).multi_processor_count


def remote_first_order(rank: int, world_size: int) -> list[int]:
    return [(rank + k) % world_size for k in range(1, world_size + 1)]


def split_programs(work: list[float], num_programs: int) -> list[int]:
    """Programs per group: one for each group with work, then each further program to the group with the most
    work per program (shares in proportion to the work)."""
    shares = [1 if w else 0 for w in work]
    if num_programs < sum(shares):
        raise ValueError(f"{num_programs} programs cannot walk {sum(shares)} destinations' tiles: use at least one "
                         f"program per destination")
    for _ in range(num_programs - sum(shares)):
        shares[max(range(len(work)), key=lambda k: work[k] / shares[k] if work[k] else -1.0)] += 1
    return shares


def plan_peer_tiles(rank: int, rows: list[tuple[int, int]], features: list[tuple[int, int]], block_rows: int,
                    num_programs: int, device: torch.device, local_tile_cost: float | None = 1.0) -> PeerTilePlan:
    """rows[d] = (begin, end) and features[d] = (first, count) of destination d. local_tile_cost: split the
    programs among the destinations, a tile for this rank costing that much against one for a peer (1: the
    tile's compute decides its time; below 1: the link does); None: one walk over every tile."""
    world = len(rows)
    order = remote_first_order(rank, world)
    tiles = [features[d][1] * triton.cdiv(rows[d][1] - rows[d][0], block_rows) for d in order]
    tile_starts = [sum(tiles[:k]) for k in range(world + 1)]
    if local_tile_cost is None:
        walk_starts = [0] + [tile_starts[-1]] * world
        program_starts = [0] + [num_programs] * world
    else:
        work = [n * (local_tile_cost if d == rank else 1.0) for n, d in zip(tiles, order)]
        shares = split_programs(work, num_programs)
        walk_starts = tile_starts
        program_starts = [sum(shares[:k]) for k in range(world + 1)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return PeerTilePlan(dest_order=tensor(order, torch.int32), tile_starts=tensor(tile_starts, torch.int32),
                        program_starts=tensor(program_starts, torch.int32),
                        walk_starts=tensor(walk_starts, torch.int32),
                        row_begin=tensor([r[0] for r in rows], torch.int64),
                        row_end=tensor([r[1] for r in rows], torch.int64),
                        feature_begin=tensor([f[0] for f in features], torch.int32), num_programs=num_programs)


@triton.jit
def program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Program pid's walk: (first tile, end, stride); the program takes tiles t, t + stride, ... below end."""
    w_offs = tl.arange(0, WORLD_P2)
    walk_ends = tl.load(program_starts_ptr + 1 + w_offs, mask=w_offs < WORLD, other=2147483647)
    w = tl.sum((walk_ends <= pid).to(tl.int32), axis=0)
    first_program = tl.load(program_starts_ptr + w)
    stride = tl.load(program_starts_ptr + w + 1) - first_program
    return tl.load(walk_starts_ptr + w) + pid - first_program, tl.load(walk_starts_ptr + w + 1), stride


@triton.jit
def next_tile_group(t, k, group_start, group_end, tile_starts_ptr):
    """The group (k, its first tile, its end) of tile t, from the group of an earlier tile: a program's tiles only
    move forward, so it starts from (0, 0, tile_starts[1]) and steps over group ends instead of searching the
    table per tile (tiles are small: a per-tile search cost the lookup 4-6%)."""
    while t >= group_end:
        k += 1
        group_start = group_end
        group_end = tl.load(tile_starts_ptr + k + 1)
    return k, group_start, group_end


@triton.jit
def tile_coords(k, u, dest_order_ptr, row_begin_ptr, row_end_ptr, feature_begin_ptr, BLOCK_ROWS: tl.constexpr):
    """Tile u of group k -> (destination, feature, row indices [BLOCK_ROWS], row mask, first row of the
    destination)."""
    dest = tl.load(dest_order_ptr + k)
    begin = tl.load(row_begin_ptr + dest)
    end = tl.load(row_end_ptr + dest)
    blocks = tl.cdiv(end - begin, BLOCK_ROWS)
    feature = tl.load(feature_begin_ptr + dest) + (u // blocks).to(tl.int32)
    rows = begin + (u % blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return dest, feature, rows, rows < end, begin
