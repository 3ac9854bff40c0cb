"""The tile walk of the push kernels: programs split among destinations, every tile walked exactly once."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.peer_tiles import next_tile_group, plan_peer_tiles, program_walk, split_programs, tile_coords


@pytest.mark.parametrize("tiles,programs", [([10, 10], 4224), ([100, 1, 1], 3), ([0, 5, 0], 4), ([3, 0, 9], 5),
                                            ([7, 300, 41, 0, 2], 64), ([0, 0], 2)])
def test_split_programs_is_proportional_and_covers_every_destination(tiles, programs):
    shares = split_programs(tiles, programs)
    assert sum(shares) == programs
    assert all((s >= 1) == (n > 0) for s, n in zip(shares, tiles) if any(tiles))
    # Balanced: the most tiles any program walks cannot drop by moving one program to another destination.
    load = lambda sh: max(n / s for n, s in zip(tiles, sh) if n)
    if any(tiles):
        for a in range(len(tiles)):
            for b in range(len(tiles)):
                if a != b and tiles[b] and shares[a] > (1 if tiles[a] else 0):
                    moved = list(shares)
                    moved[a] -= 1
                    moved[b] += 1
                    assert load(moved) >= load(shares)


def test_too_few_programs_is_a_clear_error():
    with pytest.raises(ValueError, match="3 destinations"):
        split_programs([4, 1, 2], 2)


@triton.jit
def _walk_kernel(visits_ptr, dests_ptr, tile_starts_ptr, walk_starts_ptr, program_starts_ptr, dest_order_ptr,
                 row_begin_ptr, row_end_ptr, feature_begin_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, ROW_LEN: tl.constexpr):
    """Each program counts a visit of every (feature, row) its tiles cover and records the destinations it saw
    (a bit per destination)."""
    pid = tl.program_id(0)
    t, end, stride = program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD, WORLD_P2)
    k, group_start, group_end = 0, 0, tl.load(tile_starts_ptr + 1)
    while t < end:
        k, group_start, group_end = next_tile_group(t, k, group_start, group_end, tile_starts_ptr)
        dest, f, rows, row_mask, first_row = tile_coords(k, t - group_start, dest_order_ptr, row_begin_ptr,
                                                         row_end_ptr, feature_begin_ptr, BLOCK_ROWS)
        tl.atomic_add(visits_ptr + f.to(tl.int64) * ROW_LEN + rows, 1, mask=row_mask)
        tl.atomic_or(dests_ptr + pid, 1 << dest)
        t += stride


CASES = [(1, [(0, 5), (5, 5), (5, 12)], [(0, 2), (2, 3), (5, 1)], 2, 7),  # a destination with no rows
         (0, [(0, 9), (9, 17)], [(0, 3), (0, 3)], 4, 2),  # one program per destination
         (3, [(0, 3), (3, 4), (4, 10), (10, 11)], [(0, 1), (1, 1), (2, 2), (4, 1)], 1, 13)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("rank,rows,features,block_rows,programs", CASES)
def test_every_tile_is_walked_once_and_remote_groups_come_first(rank, rows, features, block_rows, programs, split):
    plan = plan_peer_tiles(rank, rows, features, block_rows, programs, torch.device("cpu"),
                           local_tile_cost=1.0 if split else None)
    row_len = rows[-1][1]
    num_features = max(first + count for first, count in features)
    visits = torch.zeros(num_features * row_len, dtype=torch.int32)
    dests = torch.zeros(programs, dtype=torch.int32)
    world = len(rows)
    _walk_kernel[(programs,)](visits, dests, plan.tile_starts, plan.walk_starts, plan.program_starts,
                              plan.dest_order, plan.row_begin, plan.row_end, plan.feature_begin, WORLD=world,
                              WORLD_P2=triton.next_power_of_2(world), BLOCK_ROWS=block_rows, ROW_LEN=row_len)
    expected = torch.zeros(num_features, row_len, dtype=torch.int32)
    for (begin, end), (first, count) in zip(rows, features):
        expected[first:first + count, begin:end] = 1
    assert torch.equal(visits.view(num_features, row_len), expected)
    if split:  # every program stays with one destination
        assert all(d & (d - 1) == 0 for d in dests.tolist())
    assert plan.dest_order.tolist()[-1] == rank  # local last, the next rank first
    assert plan.dest_order.tolist()[0] == (rank + 1) % world
    assert plan.program_starts.tolist()[-1] == programs


def test_a_cheaper_local_tile_gives_the_peers_more_programs():
    rows, features = [(0, 64), (64, 128)], [(0, 4), (0, 4)]
    even = plan_peer_tiles(0, rows, features, 4, 60, torch.device("cpu")).program_starts.tolist()
    cheap = plan_peer_tiles(0, rows, features, 4, 60, torch.device("cpu"), local_tile_cost=0.2).program_starts.tolist()
    assert even == [0, 30, 60]  # group 0: the peer (rank 1), group 1: this rank
    assert cheap == [0, 50, 60]
