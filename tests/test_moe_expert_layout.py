"""The expert layout: dispatch and combine addresses are inverse to each other and match the bulk layer's order."""

import numpy as np
import pytest
import torch

from moe.expert_layout import (build_expert_layout, dispatch_tables, expert_row_tiles, expert_rows,
                               expert_rows_reference, gather_counts, tile_tables, tile_tables_reference)
from sm90 import compile_for_sm90
from world import run_world

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernels' tensors (CPU: interpreter)


@pytest.mark.parametrize("world,local", [(1, 3), (2, 2), (4, 1), (4, 3)])
def test_dispatch_and_combine_addresses_are_inverse(world, local):
    gen = torch.Generator().manual_seed(world * 10 + local)
    counts = torch.randint(0, 5, (world, world * local), generator=gen)
    counts[0] = 0  # a rank with no tokens
    counts[:, -1] = 0  # an expert nobody routes to
    layouts = [build_expert_layout(counts.to(DEVICE), r, local, tile_rows=4, owner_tile_rows=8)
               for r in range(world)]
    for s, lay in enumerate(layouts):
        assert lay.send_dest_row.numel() == int(counts[s].sum())
        for i, (d, row) in enumerate(zip(lay.send_dest_rank.tolist(), lay.send_dest_row.tolist())):
            assert layouts[d].recv_source_rank[row] == s and layouts[d].recv_source_row[row] == i
    for d, lay in enumerate(layouts):
        assert lay.recv_offsets[-1] == lay.recv_source_rank.numel() == sum(lay.tokens_per_local_expert)
        assert lay.max_recv_rows == max(x.recv_source_rank.numel() for x in layouts)
        assert lay.max_send_rows == int(counts.sum(dim=1).max())
        # Receive order: (local expert, source rank, source row): the bulk layer's regrouped order.
        expert = torch.repeat_interleave(torch.arange(local), torch.tensor(lay.tokens_per_local_expert))
        key = (expert * world + lay.recv_source_rank.cpu()) * 1000 + lay.recv_source_row.cpu()
        assert torch.equal(key, torch.sort(key).values)
        for e in range(local):
            for s in range(world):
                begin, end = lay.recv_offsets[e * world + s], lay.recv_offsets[e * world + s + 1]
                assert end - begin == counts[s, d * local + e]


def skewed_counts(world: int, local: int, seed: int) -> torch.Tensor:
    """Random counts C [world, experts] of 0-11 rows with one hot expert (64 more per rank: past a 64-row tile at
    its owner, across several of the rows kernel's 16-row blocks), a rank that routes nothing and an expert nobody
    routes to. Few rows otherwise: the interpreter runs a program per 16 rows (counts of 0-39 took minutes at 8
    ranks)."""
    counts = torch.randint(0, 12, (world, world * local), generator=torch.Generator().manual_seed(seed))
    counts[:, 0] += 64
    counts[world - 1] = 0
    counts[:, -1] = 0
    return counts


def tiny_runs(world: int, local: int, seed: int) -> torch.Tensor:
    """Counts of 0-2 rows per (rank, expert): a kernel program's rows span many experts' runs, empty ones among
    them."""
    return torch.randint(0, 3, (world, world * local), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world,local,make_counts", [(1, 3, skewed_counts), (2, 2, skewed_counts),
                                                     (3, 5, skewed_counts), (4, 3, skewed_counts),
                                                     (8, 8, skewed_counts), (4, 8, tiny_runs)])
def test_per_row_tables_match_the_row_by_row_reference(world, local, make_counts):
    """The kernel's tables (every row's owner and receive row, its tile on either side; every received row's source
    and source row) against a Python loop over the rows: skewed counts, a rank with no rows, an empty expert; or
    runs of 0-2 rows, many to a program."""
    counts = make_counts(world, local, seed=world * 10 + local)
    for rank in range(world):
        for tile_rows in ((1, 16), (16, 1), (16, 64)):
            want = expert_rows_reference(counts, rank, local, tile_rows)
            got = expert_rows(counts.to(DEVICE), rank, local, tile_rows, len(want[0]), len(want[4]))
            assert [t.tolist() for t in got] == want, (rank, tile_rows)


@pytest.mark.parametrize("world,local", [(2, 2), (3, 5), (4, 3)])
def test_dispatch_tables_made_before_the_host_knows_the_rows(world, local):
    """DispatchTables from the counts on the device at a receive capacity: at one that holds the rows, the layout's
    tables (the receive ones and gemm_tiles padded past the rows and tiles received; the layout then reuses the
    per-row tables) and the combine's tiles, at one that does not, the rows and tiles below it (every combine tile
    with rows below the capacity, none reaching past it); the tiles listed come back on the device."""
    counts = skewed_counts(world, local, seed=world * 10 + local)
    for rank in range(world):
        lay = build_expert_layout(counts.to(DEVICE), rank, local, tile_rows=4, owner_tile_rows=8)
        received, tiles = lay.recv_source_rank.numel(), lay.gemm_tiles.shape[1]
        combine_tiles = tile_tables_reference(counts.numpy(), rank, local, 4, 8)[1]
        for capacity in (lay.max_recv_rows + 37, received // 2 + 1):
            tables = dispatch_tables(counts.to(DEVICE), rank, local, 4, 8, int(counts[rank].sum()), capacity)
            fits = min(received, capacity)
            listed = min(tiles, -(-capacity // 8) + local)
            assert tables.row_tiles.item() == listed
            want_combine = combine_tiles.copy()
            want_combine[1] = np.clip(capacity - want_combine[0], 0, want_combine[1])  # rows cut at the capacity
            want_combine = want_combine[:, want_combine[1] > 0]  # every tile with rows below it, none past it
            combine_listed = want_combine.shape[1]
            assert combine_listed <= -(-capacity // 4) + local * world  # the table's room
            assert tables.combine_row_tiles.item() == combine_listed
            assert tables.combine_tiles[:, :combine_listed].tolist() == want_combine.tolist()
            assert tables.recv_source_rank.numel() == tables.recv_source_row.numel() == capacity
            assert torch.equal(tables.recv_source_rank[:fits], lay.recv_source_rank[:fits])
            assert torch.equal(tables.recv_source_row[:fits], lay.recv_source_row[:fits])
            for got, want in zip(tables.rows[:4], (lay.send_dest_rank, lay.send_dest_row, lay.send_tile,
                                                   lay.send_owner_tile)):
                assert torch.equal(got, want)
            if fits == received:  # both walk orders are the layout's, every combine tile listed
                assert torch.equal(tables.gemm_tiles[:, :listed], lay.gemm_tiles)
                assert combine_listed == combine_tiles.shape[1]
                again = build_expert_layout(counts.to(DEVICE), rank, local, 4, 8, dispatched=tables,
                                            host_counts=counts)
                assert again.recv_source_rank.data_ptr() == tables.recv_source_rank.data_ptr()
                assert torch.equal(again.recv_source_row, lay.recv_source_row)
            else:  # the tiles below the capacity, each once in either walk
                assert torch.equal(tables.gemm_tiles[:3, :listed], lay.gemm_tiles[:3, :listed])
                for order in tables.gemm_tiles[3:, :listed]:
                    assert sorted(order.tolist()) == list(range(listed))
    with pytest.raises(ValueError, match="the dispatch's tables cut tiles of"):
        build_expert_layout(counts.to(DEVICE), 0, local, 4, 16, dispatched=tables)


@pytest.mark.parametrize("world,local", [(1, 3), (2, 2), (3, 5), (4, 3), (2, 16)])
def test_tile_tables_match_the_numpy_reference(world, local):
    """The tile kernel's three tables (the dispatch GEMMs' tiles with both walk orders, the combine's tiles per
    (expert, source) block with their flag slots, the combine gradient GEMM's tiles) against numpy: skewed counts
    (more tiles than one chunk of the kernel), a rank with no rows, an empty expert; tiles of 1 row, equal and
    different tile sizes. The layout's tables, and the combine's from DispatchTables at the rows received."""
    counts = skewed_counts(world, local, seed=world * 10 + local + 1)
    host = counts.numpy()
    for rank in range(world):
        received = int(host[:, rank * local:(rank + 1) * local].sum())
        for tile_rows, owner_tile_rows in ((4, 8), (16, 16), (1, 16), (16, 1)):
            gemm, grad = tile_tables(counts.to(DEVICE), host, rank, local, tile_rows, owner_tile_rows)
            tables = dispatch_tables(counts.to(DEVICE), rank, local, tile_rows, owner_tile_rows,
                                     int(host[rank].sum()), received)
            combine = tables.combine_tiles[:, :tables.combine_row_tiles.item()]
            want = tile_tables_reference(host, rank, local, tile_rows, owner_tile_rows)
            for name, g, w in zip(("gemm", "combine", "combine_grad"), (gemm, combine, grad), want):
                assert g.tolist() == w.tolist(), (rank, tile_rows, owner_tile_rows, name)
                assert g.data_ptr() % 16 == 0, name  # Triton specialises pointers on this alignment


def test_counts_must_match_the_expert_split():
    with pytest.raises(ValueError, match="expected 2 ranks x 3"):
        build_expert_layout(torch.zeros(2, 4, dtype=torch.int64), 0, 3, tile_rows=4, owner_tile_rows=8)


def _gathered(rank, world):
    mine = torch.arange(6) * (rank + 1)
    assert torch.equal(gather_counts(mine), torch.stack([torch.arange(6) * (r + 1) for r in range(world)]))


def test_gather_counts_on_gloo():
    run_world(2, _gathered)


def test_expert_row_tiles_cover_each_expert_without_straddling():
    """Every row of every expert lies in exactly one tile of its own expert, tiles numbered expert by expert."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(50):
        sizes = torch.randint(0, 90, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        sizes[torch.rand(sizes.numel(), generator=gen) < 0.3] = 0  # experts without rows
        for block_m in (1, 16, 64):
            expert, begin, end = expert_row_tiles(sizes, block_m)
            want = [(e, first + i, first + n) for e, (first, n) in
                    enumerate(zip((torch.cumsum(sizes, 0) - sizes).tolist(), sizes.tolist()))
                    for i in range(0, n, block_m)]
            assert list(zip(expert.tolist(), begin.tolist(), end.tolist())) == want


def test_per_row_tables_start_on_16_byte_boundaries():
    """Triton specialises pointer arguments on 16-byte alignment: tables whose alignment changed with the row
    counts (odd counts here) would make the fused kernels compile new variants in the middle of training."""
    counts = torch.tensor([[3, 0, 5, 1], [2, 7, 0, 3]])
    for rank in range(2):
        lay = build_expert_layout(counts.to(DEVICE), rank, 2, tile_rows=4, owner_tile_rows=8)
        for name in ("send_dest_rank", "send_dest_row", "send_tile", "send_owner_tile", "recv_source_rank",
                     "recv_source_row"):
            assert getattr(lay, name).data_ptr() % 16 == 0, (rank, name)


def test_tile_tables_kernel_compiles_for_sm90():
    """The tile tables' kernel as GPUs launch it (2 ranks x 32 experts, 8 x 32; 128-row tiles)."""
    compile_for_sm90("""
from moe.expert_layout import _tile_tables_kernel
ptrs = {n: "*i64" for n in _tile_tables_kernel.arg_names if n.endswith("_ptr")}
ptrs["keys_ptr"] = "*i32"
for world, local in ((2, 32), (8, 32)):
    for places in (False, True):
        build(_tile_tables_kernel, ptrs, dict(WORLD=world, L=local, W_P2=world, L_P2=local,
                                              E_P2=triton.next_power_of_2(world * local), TILE_ROWS=128,
                                              OWNER_TILE_ROWS=128, CHUNK=64, PLACES=places))
""")


def test_rows_kernel_compiles_for_sm90():
    """The per-row tables' kernel as GPUs launch it (int64 counts and tables; 2 ranks x 32 experts, 8 x 32)."""
    compile_for_sm90("""
from moe.expert_layout import _expert_rows_kernel
ptrs = {n: "*i64" for n in _expert_rows_kernel.arg_names if n.endswith("_ptr")}
for world, local in ((2, 32), (8, 32)):
    e_p2 = triton.next_power_of_2(world * local)
    build(_expert_rows_kernel, ptrs, dict(WORLD=world, L=local, W_P2=world, E_P2=e_p2, TILE_ROWS=128,
                                          OWNER_TILE_ROWS=128, BLOCK=256))
""")
