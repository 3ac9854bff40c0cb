"""Where every routed row lives on its way to the experts and back: the contract of the fused dispatch and combine.

Every rank knows the whole count matrix C[s, g] (rows source rank s sends to global expert g; one all-gather),
so every rank computes the same buffer sizes (symmetric allocation is collective) and each side knows, without
asking, where its rows go:
- a source's permuted rows are grouped by global expert (moe.permute): expert g's rows start at
  sum(C[s, :g]);
- the owner d of experts d*L .. d*L+L-1 receives rows ordered (local expert, source rank, source row order),
  the order its grouped GEMM consumes; block (e, s) starts at recv_offsets[e * world + s].
Dispatch stores source row i at `send_dest_row[i]` of owner `send_dest_rank[i]`; combine stores the owner's
expert output row j back at row `recv_source_row[j]` of rank `recv_source_rank[j]`, the source's permuted order,
which `moe.permute.unpermute` consumes. The owner's grouped GEMMs walk row tiles that the tile tables list
(`tile_tables`), in the order their rows arrive or leave.

The forward needs no host-known size: its tables (`DispatchTables`: the dispatch's and the combine's) are made from
the counts on the device at a receive capacity chosen beforehand, so that the host launches the whole forward
without reading the counts; the backward's tables (`build_expert_layout`) come from the counts on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import CompiledLaunches, aligned
from fused_dlrm.kernels.peer_tiles import remote_first_order


@dataclass
class ExpertLayout:
    counts: torch.Tensor  # int64 [world, num_experts], C[s, g]; the same on every rank
    host_counts: np.ndarray  # the same on the host: sizes and tile tables are derived from it without a sync
    rank: int
    world: int
    num_local_experts: int
    # this rank as a source: its permuted rows (grouped by global expert)
    send_dest_rank: torch.Tensor  # int64 [rows sent]
    send_dest_row: torch.Tensor  # int64 [rows sent]: row in the owner's receive buffer
    send_tile: torch.Tensor  # int64 [rows sent]: the tile holding the row when each expert's rows are cut into
    # tiles of `tile_rows`, numbered expert by expert (the combine's flag slots)
    tile_rows: int
    send_owner_tile: torch.Tensor  # int64 [rows sent]: the tile holding the row in its owner when each local
    # expert's received rows are cut into tiles of `owner_tile_rows`, numbered expert by expert (the flag slots of
    # the dispatch's backward)
    owner_tile_rows: int
    # this rank as an owner: the rows its experts receive
    recv_offsets: np.ndarray  # int64 [num_local_experts * world + 1]: block (e, s) starts at [e * world + s] (the
    # host builds the owners' tile tables from it)
    recv_source_rank: torch.Tensor  # int64 [rows received]
    recv_source_row: torch.Tensor  # int64 [rows received]: row in the source's permuted rows
    tokens_per_local_expert: list[int]
    max_recv_rows: int  # over all ranks: receive buffers are sized by it (same on every rank)
    max_send_rows: int  # over all ranks: combine buffers are sized by it
    # this rank as an owner: the row tiles of its grouped GEMMs (`tile_tables`), int64 on the counts' device
    gemm_tiles: torch.Tensor  # [5, tiles of owner_tile_rows]: local expert, first row, end row of the expert, then
    # two walk orders: the rows' arrival (dispatch GEMM 1) and their departure (its backward GEMM)
    combine_grad_tiles: torch.Tensor  # [3, tiles of tile_rows]: local expert, first row, end row (its grad_h GEMM)

    @property
    def total_rows(self) -> int:
        """Rows of the call over all ranks: the most one owner can receive."""
        return int(self.host_counts.sum())


@dataclass
class DispatchTables:
    """What the forward's kernels (the dispatch's push and GEMM 1, the combine's GEMM 2 and weighted unpermute)
    read, made from the counts on the device, so that the host launches them without waiting for the counts: the
    receive side covers `capacity` rows, chosen before the counts were seen. Rows past it are neither pushed nor
    computed; unless the capacity is a bound no routing can exceed (moe.layer: FusedMoEConfig.max_tokens_per_rank),
    the caller compares ExpertLayout.max_recv_rows with it once the counts reach the host and, when the rows did
    not fit, dispatches again in larger buffers."""
    counts: torch.Tensor  # int64 [world, num_experts], C[s, g]
    rank: int
    world: int
    num_local_experts: int
    tile_rows: tuple[int, int]  # the combine's row tiles, the owner's (expert_rows)
    capacity: int  # receive rows covered
    rows: list[torch.Tensor]  # expert_rows' tables; the two receive tables have `capacity` entries
    gemm_tiles: torch.Tensor  # [5, max row tiles]: ExpertLayout.gemm_tiles, its first `row_tiles` columns filled
    row_tiles: torch.Tensor  # int64 [1]: the row tiles gemm_tiles lists
    combine_tiles: torch.Tensor  # [6, max tiles]: the combine GEMM's row tiles, its first `combine_row_tiles`
    # columns filled: first row, rows (none past `capacity`), local expert, source, first source row, flag slot; one
    # (local expert, source) block each, remote sources first
    combine_row_tiles: torch.Tensor  # int64 [1]: the tiles combine_tiles lists

    @property
    def send_dest_rank(self) -> torch.Tensor:
        return self.rows[0]

    @property
    def send_dest_row(self) -> torch.Tensor:
        return self.rows[1]

    @property
    def send_tile(self) -> torch.Tensor:
        return self.rows[2]

    @property
    def recv_source_rank(self) -> torch.Tensor:
        return self.rows[4]

    @property
    def recv_source_row(self) -> torch.Tensor:
        return self.rows[5]


def receive_capacity(rows: int, current: int, total_rows: int, multiple: int = 1) -> int:
    """The receive rows per owner to hold a call's `rows` (ExpertLayout.max_recv_rows) when `current` rows were
    held so far (0: none yet); the same on every rank, as its inputs are.

    It never shrinks. When it grows, it takes a quarter more than asked, up to `total_rows` (every row of the call
    to one owner, the most any call of that size can ask for): under drifting routing the largest owner's rows creep
    up, and growing to each new peak re-allocates collectively and, in the layer, dispatches again (24 times in
    40 steps of the fine-grained MoE Transformer's 8 layers on 2 x H200; 7 with a quarter to spare). Steps of an
    eighth of a power of two, a multiple of `multiple`: the capacity sizes per-layer activations (h, a13), so no
    doubling."""
    rows = max(rows, multiple)  # no call asks for less (a call with no rows at all needs buffers too)
    if rows <= current:
        return current
    want = max(rows, min(rows + rows // 4, total_rows))
    step = max(multiple, (1 << max(0, want.bit_length() - 4)) // multiple * multiple)
    return -(-want // step) * step


def _checked(counts: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """counts, contiguous (kernels read it whole), once its experts are known to split over its ranks."""
    world, num_experts = counts.shape
    if num_experts != world * num_local_experts:
        raise ValueError(f"counts has {num_experts} experts; expected {world} ranks x {num_local_experts}")
    return counts.contiguous()


def dispatch_tables(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: int, owner_tile_rows: int,
                    num_sent: int, capacity: int) -> DispatchTables:
    """DispatchTables for `capacity` receive rows; num_sent (this rank's permuted rows) is the permutation's length,
    which the host knows. Three kernel launches, no host sync."""
    world, counts = counts.shape[0], _checked(counts, num_local_experts)
    rows = expert_rows(counts, rank, num_local_experts, (tile_rows, owner_tile_rows), num_sent, capacity)
    # Row tiles of `capacity` rows: at most one partial tile per local expert (GEMM 1) or per (local expert, source)
    # block (GEMM 2) besides the full ones.
    bounds = (triton.cdiv(capacity, owner_tile_rows) + num_local_experts,
              triton.cdiv(capacity, tile_rows) + num_local_experts * world, 0)
    gemm, listed, combine, combine_listed, _ = _tile_tables(counts, rank, num_local_experts, tile_rows,
                                                            owner_tile_rows, bounds, capacity)
    return DispatchTables(counts, rank, world, num_local_experts, (tile_rows, owner_tile_rows), capacity, rows, gemm,
                          listed, combine, combine_listed)


def build_expert_layout(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: int,
                        owner_tile_rows: int, dispatched: DispatchTables | None = None,
                        host_counts: torch.Tensor | None = None) -> ExpertLayout:
    """counts: int64 [world, num_experts] on any device; the layout's tensors live on that device. `tile_rows`,
    `owner_tile_rows`: the row tiles of the combine's GEMM and of the dispatch's backward GEMM. Reading the
    counts is the one host sync of a fused MoE layer. The host derives, in numpy, the sizes and the receive
    blocks' starts and the tile counts; the per-row tables and the tile tables come from the counts on the device,
    in one kernel each (no copy from the host: the host's time per layer is what the fused layer is short of).
    `dispatched`: the dispatch's tables of these counts, whose per-row tables are reused when they hold every
    received row. `host_counts`: the counts already copied to the host (fused_dlrm.dist.host_copy.PendingHostCopy:
    a `.cpu()` here would wait for every kernel queued since the counts were made)."""
    world, counts = counts.shape[0], _checked(counts, num_local_experts)
    c = (counts.cpu() if host_counts is None else host_counts).numpy()
    # owner_blocks[d]: [L, world] counts in receive order (every owner's: the buffers are sized by the largest).
    owner_blocks = c.reshape(world, world, num_local_experts).transpose(1, 2, 0).reshape(world, -1)
    my_blocks = owner_blocks[rank]
    num_received = int(my_blocks.sum())
    if dispatched is not None and dispatched.tile_rows != (tile_rows, owner_tile_rows):
        raise ValueError(f"the dispatch's tables cut tiles of {dispatched.tile_rows} rows, the layout "
                         f"{(tile_rows, owner_tile_rows)}")
    if dispatched is not None and dispatched.capacity >= num_received:
        tables = dispatched.rows[:4] + [t[:num_received] for t in dispatched.rows[4:]]
    else:
        tables = expert_rows(counts, rank, num_local_experts, (tile_rows, owner_tile_rows), int(c[rank].sum()),
                             num_received)
    tiles = tile_tables(counts, c, rank, num_local_experts, tile_rows, owner_tile_rows)
    return ExpertLayout(
        counts=counts, host_counts=c, rank=rank, world=world, num_local_experts=num_local_experts,
        send_dest_rank=tables[0], send_dest_row=tables[1], send_tile=tables[2], tile_rows=tile_rows,
        send_owner_tile=tables[3], owner_tile_rows=owner_tile_rows,
        recv_offsets=np.concatenate([[0], np.cumsum(my_blocks)]), recv_source_rank=tables[4],
        recv_source_row=tables[5],
        tokens_per_local_expert=my_blocks.reshape(num_local_experts, world).sum(axis=1).tolist(),
        max_recv_rows=int(owner_blocks.sum(axis=1).max()), max_send_rows=int(c.sum(axis=1).max()),
        gemm_tiles=tiles[0], combine_grad_tiles=tiles[1])


@triton.jit(do_not_specialize=["rank", "num_sent", "num_received", "send_programs"])  # one variant for all steps
def _expert_rows_kernel(counts_ptr, send_rank_ptr, send_row_ptr, send_tile_ptr, send_owner_tile_ptr, recv_rank_ptr,
                        recv_row_ptr, rank, num_sent, num_received, send_programs, WORLD: tl.constexpr,
                        L: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr, TILE_ROWS: tl.constexpr,
                        OWNER_TILE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Programs [0, send_programs): BLOCK of this rank's permuted rows each; the rest: BLOCK of its received rows.
    Rows come in runs (an expert's rows on the source side, a block on the owner side) that a run's values fix,
    and a program's rows span few of them: it walks the runs from its first row's to its last row's, each run's
    values reduced from the counts (read whole, [world, E]) to scalars, and stores the rows inside the run. The
    work per program is BLOCK rows plus E per run, not BLOCK x E (which took 30-66 us at issue 4's configs)."""
    E: tl.constexpr = WORLD * L
    pid = tl.program_id(0)
    g = tl.arange(0, E_P2)  # global expert, or the owner's block (local expert g // WORLD, source g % WORLD)
    s = tl.arange(0, W_P2)
    if pid < send_programs:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        last = tl.minimum(pid * BLOCK + BLOCK, num_sent) - 1
        mine = tl.load(counts_ptr + rank * E + g, mask=g < E, other=0).to(tl.int32)
        ends = tl.cumsum(mine, axis=0)  # of expert g's rows
        c = tl.load(counts_ptr + s[:, None] * E + g[None, :], mask=(s[:, None] < WORLD) & (g[None, :] < E),
                    other=0).to(tl.int32)
        rows_of_expert = tl.sum(c, axis=0)
        from_earlier_sources = tl.sum(tl.where(s[:, None] < rank, c, 0), axis=0)
        tiles = (mine + TILE_ROWS - 1) // TILE_ROWS
        first_tiles = tl.cumsum(tiles, axis=0) - tiles
        owner_tiles = (rows_of_expert + OWNER_TILE_ROWS - 1) // OWNER_TILE_ROWS
        expert = tl.sum((ends <= pid * BLOCK).to(tl.int32), axis=0)  # the first run not ended before the block
        last_expert = tl.sum((ends <= last).to(tl.int32), axis=0)  # the run of the block's last row
        while expert <= last_expert:
            within = i - _at(ends - mine, g, expert)
            owner = expert // L
            # Block (local expert, rank) of its owner starts after the owner's rows of earlier local experts and
            # after the rows of this expert from earlier sources.
            earlier = (g // L == owner) & (g < expert)
            in_expert = _at(from_earlier_sources, g, expert) + within  # owner's row - expert's
            ok = (within >= 0) & (within < _at(mine, g, expert)) & (i < num_sent)
            tl.store(send_rank_ptr + i, owner.to(tl.int64), mask=ok)
            tl.store(send_row_ptr + i, (tl.sum(tl.where(earlier, rows_of_expert, 0), axis=0) + in_expert).to(tl.int64),
                     mask=ok)
            tl.store(send_tile_ptr + i, (_at(first_tiles, g, expert) + within // TILE_ROWS).to(tl.int64), mask=ok)
            tl.store(send_owner_tile_ptr + i, (tl.sum(tl.where(earlier, owner_tiles, 0), axis=0)
                                               + in_expert // OWNER_TILE_ROWS).to(tl.int64), mask=ok)
            expert += 1
    else:
        first_j = (pid - send_programs) * BLOCK
        size = tl.load(counts_ptr + (g % WORLD) * E + rank * L + g // WORLD, mask=g < E, other=0).to(tl.int32)
        filled = tl.minimum(num_received, tl.sum(size, axis=0))  # num_received may be a capacity
        if first_j < filled:  # a bounded capacity is often twice the rows received: the rest have nothing to do
            j = first_j + tl.arange(0, BLOCK)
            last = tl.minimum(first_j + BLOCK, filled) - 1
            ends = tl.cumsum(size, axis=0)
            block = tl.sum((ends <= first_j).to(tl.int32), axis=0)
            last_block = tl.sum((ends <= last).to(tl.int32), axis=0)
            while block <= last_block:
                within = j - _at(ends - size, g, block)
                source = block % WORLD
                ok = (within >= 0) & (within < _at(size, g, block)) & (j < filled)
                # The source's permuted rows of the expert start after its rows of earlier experts.
                rows_before = tl.sum(tl.load(counts_ptr + source * E + g, mask=g < rank * L + block // WORLD,
                                             other=0).to(tl.int32), axis=0)
                tl.store(recv_rank_ptr + j, source.to(tl.int64), mask=ok)
                tl.store(recv_row_ptr + j, (rows_before + within).to(tl.int64), mask=ok)
                block += 1


def expert_rows(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: tuple[int, int], num_sent: int,
                num_received: int) -> list[torch.Tensor]:
    """The per-row tables on counts' device: [send_dest_rank, send_dest_row, send_tile, send_owner_tile] of this
    rank's permuted rows (tile_rows: the source's tiles, the owner's) and [recv_source_rank, recv_source_row] of
    its received rows (int64), views of one buffer, each starting on a 16-byte boundary: Triton specialises
    pointers on that alignment, and a changing one would compile kernels anew in the middle of training.
    `num_received`: the receive tables' length, the rows received or, before the host knows them, a capacity
    (the kernel fills the first min(capacity, rows received) entries and leaves the rest as they are)."""
    world, num_experts = counts.shape
    counts = counts.contiguous()  # read whole
    sent, received = _even(num_sent), _even(num_received)
    flat = torch.empty(4 * sent + 2 * received, dtype=torch.int64, device=counts.device)
    tables = [flat[k * sent:k * sent + num_sent] for k in range(4)]
    tables += [flat[4 * sent + k * received:4 * sent + k * received + num_received] for k in range(2)]
    e_p2 = triton.next_power_of_2(num_experts)
    block = 256 if counts.is_cuda else 16  # rows per program (a few runs each); small on the CPU: runs cross blocks
    send_programs = triton.cdiv(num_sent, block)
    programs = send_programs + triton.cdiv(num_received, block)
    if programs:
        shape = (world, num_local_experts, triton.next_power_of_2(world), e_p2, *tile_rows, block)
        args = (counts, *tables, rank, num_sent, num_received, send_programs, *shape)
        _ROWS_LAUNCHES((counts.device, counts.dtype, *shape, *map(aligned, (counts, *tables))), (programs, 1, 1), args,
                       dict(num_warps=4 if counts.is_cuda else 1))
    return tables


def expert_rows_reference(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: tuple[int, int]
                          ) -> list[list[int]]:
    """What `expert_rows` computes, row by row in Python: every owner's receive order is (local expert,
    source, the source's row order), a source's permuted rows are grouped by global expert."""
    c = counts.tolist()
    world, num_experts = len(c), len(c[0])
    first_row = [[sum(row[:g]) for g in range(num_experts)] for row in c]  # of expert g's rows, per source
    received = {d: [(s, first_row[s][d * num_local_experts + e] + k) for e in range(num_local_experts)
                    for s in range(world) for k in range(c[s][d * num_local_experts + e])] for d in range(world)}
    where = {(s, row): (d, at) for d, rows in received.items() for at, (s, row) in enumerate(rows)}
    sent = [where[rank, i] for i in range(sum(c[rank]))]
    tiles = [sum(-(-n // tile_rows[0]) for n in c[rank][:g]) + k // tile_rows[0]
             for g in range(num_experts) for k in range(c[rank][g])]
    owner_tiles = []
    for d, at in sent:  # the owner's local expert whose rows hold `at`, then the tile within it
        rows = [sum(c[s][d * num_local_experts + e] for s in range(world)) for e in range(num_local_experts)]
        e = max(e for e in range(num_local_experts) if sum(rows[:e]) <= at and rows[e])
        owner_tiles.append(sum(-(-n // tile_rows[1]) for n in rows[:e]) + (at - sum(rows[:e])) // tile_rows[1])
    return [[d for d, _ in sent], [at for _, at in sent], tiles, owner_tiles, [s for s, _ in received[rank]],
            [row for _, row in received[rank]]]


def _even(n: int) -> int:
    """n rounded up to a multiple of 2: int64 rows of that many end on a 16-byte boundary."""
    return n + n % 2


def expert_row_tiles(sizes: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row tiles of a grouped GEMM over contiguous experts of `sizes` rows (int64, on the host): tiles of
    block_m rows that never straddle two experts, numbered expert by expert. Returns (expert, first row, end
    row of the tile's expert) per tile; a tile's rows are first .. min(first + block_m, end) - 1."""
    sizes = np.asarray(sizes, dtype=np.int64)
    per_expert = (sizes + block_m - 1) // block_m
    expert = np.repeat(np.arange(sizes.size), per_expert)
    first_tile = np.cumsum(per_expert) - per_expert
    first_row = np.cumsum(sizes) - sizes
    begin = first_row[expert] + (np.arange(expert.size) - first_tile[expert]) * block_m
    return expert, begin, (first_row + sizes)[expert]


# -- the owner's tile tables ---------------------------------------------------------------------------------------
def tile_counts(host_counts: np.ndarray, rank: int, num_local_experts: int, tile_rows: int,
                owner_tile_rows: int) -> tuple[int, int]:
    """Columns of the layout's two tile tables (gemm_tiles, combine_grad_tiles) of owner `rank`, from C on the
    host."""
    sizes = host_counts[:, rank * num_local_experts:(rank + 1) * num_local_experts].sum(axis=0)
    return int((-(-sizes // owner_tile_rows)).sum()), int((-(-sizes // tile_rows)).sum())


def send_slots(host_counts: np.ndarray, tile_rows: int) -> int:
    """The most combine flag slots one source numbers (its tiles of `tile_rows` per global expert), from C."""
    return int((-(-np.asarray(host_counts) // tile_rows)).sum(axis=1).max())


def tile_tables_reference(host_counts: np.ndarray, rank: int, num_local_experts: int, tile_rows: int,
                          owner_tile_rows: int) -> list[np.ndarray]:
    """In numpy: [gemm_tiles, combine_tiles, combine_grad_tiles] (the layout's `tile_tables`; combine_tiles:
    DispatchTables').
    Walk orders: arrival, tiles of this rank's rows only first, then by the rotated rank of the latest source among
    the tile's rows (rank - 1 pushes here first); departure, by the rotated rank of the tile's sources, rank + 1
    first, tiles holding this rank's rows last (stable: expert order among equals)."""
    c, L = np.asarray(host_counts, dtype=np.int64), num_local_experts
    world = c.shape[0]
    blocks = c[:, rank * L:(rank + 1) * L].T  # [local expert, source] rows
    sizes = blocks.sum(axis=1)
    block_start = (np.cumsum(blocks.reshape(-1)) - blocks.reshape(-1)).reshape(L, world)  # block (e, s)'s first row
    expert, begin, end = expert_row_tiles(sizes, owner_tile_rows)
    lo = block_start[expert]  # source s's rows of expert e are block (e, s): a tile reads from s if they meet
    reads = ((blocks[expert] > 0) & (lo < np.minimum(begin + owner_tile_rows, end)[:, None])
             & (lo + blocks[expert] > begin[:, None]))
    sources = np.arange(world)
    orders = [np.argsort(np.where(reads, rotated, 0).max(axis=1, initial=0), kind="stable")
              for rotated in ((rank - sources) % world, (sources - rank - 1) % world)]
    gemm = np.stack([expert, begin, end, *orders])

    tiles_per = -(-c // tile_rows)  # [source, global expert]
    slot_base = np.cumsum(tiles_per, axis=1) - tiles_per
    source_start = np.cumsum(c, axis=1) - c
    walk_sources = np.repeat(remote_first_order(rank, world), L)
    experts = np.tile(np.arange(L), world)
    g = rank * L + experts
    n = tiles_per[walk_sources, g]  # tiles of each (expert, source) block, in walk order
    # Per block, then expanded to its tiles in one go; tile i of a block starts i * tile_rows rows further on.
    block = np.repeat(np.stack([block_start[experts, walk_sources], c[walk_sources, g], experts, walk_sources,
                                source_start[walk_sources, g], slot_base[walk_sources, g], np.cumsum(n) - n]), n,
                      axis=1)
    i = np.arange(block.shape[1]) - block[6]
    combine = np.stack([block[0] + i * tile_rows, np.minimum(block[1] - i * tile_rows, tile_rows), block[2],
                        block[3], block[4] + i * tile_rows, block[5] + i])
    return [gemm, combine, np.stack(expert_row_tiles(sizes, tile_rows))]


@triton.jit
def _pick(values, index, R: tl.constexpr):
    """values[index] for a vector of R values and a vector of indices in [0, R) (one compare per pair: R is the
    experts' or the blocks' count)."""
    r = tl.arange(0, R)
    return tl.sum(tl.where(r[None, :] == index[:, None], values[None, :], 0), axis=1)


@triton.jit
def _at(values, g, index):
    """values[index] for a vector of values at g = arange(...) and one index (`_pick`'s scalar form)."""
    return tl.sum(tl.where(g == index, values, 0), axis=0)


@triton.jit
def _run_of(i, run_lengths):
    """The run holding item i when runs of `run_lengths` items follow each other (empty runs hold none)."""
    ends = tl.cumsum(run_lengths, axis=0)
    return tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), axis=1)


@triton.jit
def _expert_tiles(i, sizes, BLOCK_M: tl.constexpr, L_P2: tl.constexpr):
    """Tiles i of BLOCK_M rows over contiguous experts of `sizes` rows -> (expert, first row, end row)."""
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    first_row = tl.cumsum(sizes, axis=0) - sizes
    expert = _run_of(i, tiles)
    begin = _pick(first_row, expert, L_P2) + (i - _pick(tl.cumsum(tiles, axis=0) - tiles, expert, L_P2)) * BLOCK_M
    return expert, begin, _pick(first_row + sizes, expert, L_P2)


@triton.jit
def _walk_keys(expert, begin, end, blocks, rank, WORLD: tl.constexpr, W_P2: tl.constexpr, L_P2: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Per tile, the rotated rank of the last source its rows arrive from (rank - 1 first) and of the first they
    leave to (rank + 1 first); 0 for tiles of this rank's rows only. blocks: [source, local expert] rows."""
    s = tl.arange(0, W_P2)[:, None]
    sizes = tl.sum(blocks, axis=0)
    first_row = tl.cumsum(sizes, axis=0) - sizes
    arrive = tl.zeros_like(expert)
    leave = tl.zeros_like(expert)
    for source in tl.static_range(WORLD):  # block (e, source) of the owner's rows
        lo = _pick(first_row + tl.sum(tl.where(s < source, blocks, 0), axis=0), expert, L_P2)
        n = _pick(tl.sum(tl.where(s == source, blocks, 0), axis=0), expert, L_P2)
        reads = (n > 0) & (lo < tl.minimum(begin + BLOCK_M, end)) & (lo + n > begin)
        arrive = tl.maximum(arrive, tl.where(reads, (rank - source + WORLD) % WORLD, 0))
        leave = tl.maximum(leave, tl.where(reads, (source - rank - 1 + WORLD) % WORLD, 0))
    return arrive, leave


@triton.jit
def _key_counts(key, valid, W_P2: tl.constexpr):
    """[tiles, keys]: 1 where the tile has that key."""
    return ((key[:, None] == tl.arange(0, W_P2)[None, :]) & valid[:, None]).to(tl.int32)


@triton.jit
def _place(key, valid, before, W_P2: tl.constexpr):
    """A chunk's places in a stable sort by key, given the tiles placed before it per key (`before`: those of
    smaller keys and of this key in earlier chunks) -> (places, `before` for the next chunk)."""
    hits = _key_counts(key, valid, W_P2)
    within = tl.sum(tl.where(hits != 0, tl.cumsum(hits, axis=0) - 1, 0), axis=1)
    return _pick(before, key, W_P2) + within, before + tl.sum(hits, axis=0)


@triton.jit(do_not_specialize=["rank", "n_gemm", "n_combine", "n_grad", "gemm_chunks", "combine_chunks",
                            "capacity"])
def _tile_tables_kernel(counts_ptr, gemm_ptr, gemm_count_ptr, combine_ptr, combine_count_ptr, grad_ptr, keys_ptr,
                        rank, n_gemm, n_combine, n_grad, gemm_chunks, combine_chunks, capacity,
                        WORLD: tl.constexpr, L: tl.constexpr, W_P2: tl.constexpr, L_P2: tl.constexpr,
                        E_P2: tl.constexpr, TILE_ROWS: tl.constexpr, OWNER_TILE_ROWS: tl.constexpr,
                        CHUNK: tl.constexpr, PLACES: tl.constexpr):
    """One program per CHUNK tiles of a table: gemm_tiles' chunks, then combine_tiles' (DispatchTables), then
    combine_grad_tiles' (ExpertLayout). gemm_tiles has n_gemm columns and combine_tiles n_combine: before the host
    knows the owner's row tiles, a bound; the tables list the first min(bound, tiles), and that number is stored at
    gemm_count_ptr / combine_count_ptr; combine_tiles' rows end at the receive `capacity`. Launched twice: first
    (PLACES=False) every table's columns, except the GEMM's walk orders, whose chunks store their tiles per key (keys
    [gemm_chunks, 2, W_P2]); then (PLACES=True, the GEMM's chunks) the walk orders, a stable counting sort by key: a
    tile's place is the number of tiles of smaller keys, plus those of its key in earlier chunks, plus those before
    it in its chunk."""
    E: tl.constexpr = WORLD * L
    pid = tl.program_id(0)
    s = tl.arange(0, W_P2)
    e = tl.arange(0, L_P2)
    lanes = tl.arange(0, CHUNK)
    blocks = tl.load(counts_ptr + s[:, None] * E + rank * L + e[None, :], mask=(s[:, None] < WORLD) & (e[None, :] < L),
                     other=0).to(tl.int32)  # [source, local expert]
    sizes = tl.sum(blocks, axis=0)
    if pid < gemm_chunks:
        listed = tl.minimum(tl.sum((sizes + OWNER_TILE_ROWS - 1) // OWNER_TILE_ROWS, axis=0), n_gemm)
        i = pid * CHUNK + lanes
        valid = i < listed
        expert, begin, end = _expert_tiles(i, sizes, OWNER_TILE_ROWS, L_P2)
        arrive, leave = _walk_keys(expert, begin, end, blocks, rank, WORLD, W_P2, L_P2, OWNER_TILE_ROWS)
        if PLACES:
            arrivals = tl.zeros([W_P2], tl.int32)  # tiles per key, all chunks
            departures = tl.zeros([W_P2], tl.int32)
            arrivals_before = tl.zeros([W_P2], tl.int32)  # tiles per key in the chunks before this one
            departures_before = tl.zeros([W_P2], tl.int32)
            first = 0
            while first < gemm_chunks:  # `while`: the interpreter cannot range() up to an argument
                chunks = first + lanes
                at = keys_ptr + chunks[:, None] * (2 * W_P2) + s[None, :]
                there = (chunks < gemm_chunks)[:, None]
                arrive_counts = tl.load(at, mask=there, other=0)
                leave_counts = tl.load(at + W_P2, mask=there, other=0)
                arrivals += tl.sum(arrive_counts, axis=0)
                departures += tl.sum(leave_counts, axis=0)
                arrivals_before += tl.sum(tl.where((chunks < pid)[:, None], arrive_counts, 0), axis=0)
                departures_before += tl.sum(tl.where((chunks < pid)[:, None], leave_counts, 0), axis=0)
                first += CHUNK
            place, _ = _place(arrive, valid, tl.cumsum(arrivals, axis=0) - arrivals + arrivals_before, W_P2)
            tl.store(gemm_ptr + 3 * n_gemm + place, i.to(tl.int64), mask=valid)
            place, _ = _place(leave, valid, tl.cumsum(departures, axis=0) - departures + departures_before, W_P2)
            tl.store(gemm_ptr + 4 * n_gemm + place, i.to(tl.int64), mask=valid)
        else:
            if pid == 0:
                tl.store(gemm_count_ptr, listed.to(tl.int64))
            tl.store(gemm_ptr + i, expert.to(tl.int64), mask=valid)
            tl.store(gemm_ptr + n_gemm + i, begin.to(tl.int64), mask=valid)
            tl.store(gemm_ptr + 2 * n_gemm + i, end.to(tl.int64), mask=valid)
            tl.store(keys_ptr + pid * (2 * W_P2) + s, tl.sum(_key_counts(arrive, valid, W_P2), axis=0))
            tl.store(keys_ptr + pid * (2 * W_P2) + W_P2 + s, tl.sum(_key_counts(leave, valid, W_P2), axis=0))
    elif pid < gemm_chunks + combine_chunks:
        # Blocks in walk order: b = k * L + e is local expert e's block from source rank + 1 + k (this rank last).
        b = tl.arange(0, E_P2)
        in_walk = b < E
        source = (rank + 1 + b // L) % WORLD
        local = b % L
        global_expert = rank * L + local
        # The block's first row at the owner: rows of earlier local experts, then this expert's from earlier sources.
        first_row = (_pick(tl.cumsum(sizes, axis=0) - sizes, local, L_P2)
                     + tl.sum(tl.where(s[:, None] < source[None, :],
                                       tl.load(counts_ptr + s[:, None] * E + global_expert[None, :],
                                               mask=(s[:, None] < WORLD) & in_walk[None, :], other=0), 0),
                              axis=0).to(tl.int32))
        # Only the rows below the capacity, where h and the owner's row buffers end (GEMM 1 stops there too): rows
        # that outgrew it (the layer dispatches again before any combine) or a bound that did not hold
        # (max_tokens_per_rank; the layer's backward refuses that call). The table has room for the tiles of
        # `capacity` rows: tiles past it would take the places of tiles below it later in the walk (whose sources
        # count rows past it as dropped: FusedCombine.finish).
        rows = tl.load(counts_ptr + source * E + global_expert, mask=in_walk, other=0).to(tl.int32)
        rows = tl.minimum(rows, tl.maximum(capacity - first_row, 0))
        # The source's rows of earlier global experts: where its rows of this expert start, and their flag slots.
        g = tl.arange(0, E_P2)[None, :]
        earlier = tl.load(counts_ptr + source[:, None] * E + g, mask=in_walk[:, None] & (g < global_expert[:, None]),
                          other=0).to(tl.int32)
        source_row = tl.sum(earlier, axis=1)
        slot = tl.sum((earlier + TILE_ROWS - 1) // TILE_ROWS, axis=1)
        tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
        first_tile = tl.cumsum(tiles, axis=0) - tiles
        listed = tl.minimum(tl.sum(tiles, axis=0), n_combine)
        if pid == gemm_chunks:
            tl.store(combine_count_ptr, listed.to(tl.int64))
        i = (pid - gemm_chunks) * CHUNK + lanes
        valid = i < listed
        block = _run_of(i, tiles)
        k = i - _pick(first_tile, block, E_P2)  # the tile's place in its block
        out = combine_ptr + i
        tl.store(out, (_pick(first_row, block, E_P2) + k * TILE_ROWS).to(tl.int64), mask=valid)
        tl.store(out + n_combine, tl.minimum(_pick(rows, block, E_P2) - k * TILE_ROWS, TILE_ROWS).to(tl.int64),
                 mask=valid)
        tl.store(out + 2 * n_combine, _pick(local, block, E_P2).to(tl.int64), mask=valid)
        tl.store(out + 3 * n_combine, _pick(source, block, E_P2).to(tl.int64), mask=valid)
        tl.store(out + 4 * n_combine, (_pick(source_row, block, E_P2) + k * TILE_ROWS).to(tl.int64), mask=valid)
        tl.store(out + 5 * n_combine, (_pick(slot, block, E_P2) + k).to(tl.int64), mask=valid)
    else:
        i = (pid - gemm_chunks - combine_chunks) * CHUNK + lanes
        valid = i < n_grad
        expert, begin, end = _expert_tiles(i, sizes, TILE_ROWS, L_P2)
        tl.store(grad_ptr + i, expert.to(tl.int64), mask=valid)
        tl.store(grad_ptr + n_grad + i, begin.to(tl.int64), mask=valid)
        tl.store(grad_ptr + 2 * n_grad + i, end.to(tl.int64), mask=valid)


def tile_tables(counts: torch.Tensor, host_counts: np.ndarray, rank: int, num_local_experts: int, tile_rows: int,
                owner_tile_rows: int) -> list[torch.Tensor]:
    """[gemm_tiles, combine_grad_tiles] (ExpertLayout) of owner `rank` on counts' device, in one launch
    (`tile_tables_reference` in numpy; two launches); views of one buffer, each starting on a 16-byte boundary."""
    n_gemm, n_grad = tile_counts(host_counts, rank, num_local_experts, tile_rows, owner_tile_rows)
    gemm, _, _, _, grad = _tile_tables(counts, rank, num_local_experts, tile_rows, owner_tile_rows,
                                       (n_gemm, 0, n_grad))
    return [gemm, grad]


def _tile_tables(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: int, owner_tile_rows: int,
                 sizes: tuple[int, int, int], capacity: int = 0) -> list[torch.Tensor]:
    """[gemm_tiles, gemm tiles listed, combine_tiles, combine tiles listed, combine_grad_tiles] of sizes[k]
    columns (0: that table is not made), views of one buffer; combine_tiles' rows end at `capacity`."""
    world, counts = counts.shape[0], counts.contiguous()  # read whole
    shapes = [(5, sizes[0]), (1, 1), (6, sizes[1]), (1, 1), (3, sizes[2])]
    starts = np.cumsum([0] + [_even(k * n) for k, n in shapes])
    flat = torch.empty(int(starts[-1]), dtype=torch.int64, device=counts.device)
    tables = [flat[int(a):int(a) + k * n].view(k, n) for a, (k, n) in zip(starts, shapes)]
    tables[1], tables[3] = tables[1].view(1), tables[3].view(1)
    chunk = 64 if counts.is_cuda else 16
    chunks = [triton.cdiv(n, chunk) for n in sizes]
    if sum(chunks):
        w_p2 = triton.next_power_of_2(world)
        keys = torch.empty(max(chunks[0], 1) * 2 * w_p2, dtype=torch.int32, device=counts.device)
        shape = (world, num_local_experts, w_p2, triton.next_power_of_2(num_local_experts),
                 triton.next_power_of_2(world * num_local_experts), tile_rows, owner_tile_rows, chunk)
        tensors = (counts, *tables, keys)
        for places, programs in ((False, sum(chunks)), (True, chunks[0])):
            if programs:
                _TILE_LAUNCHES((counts.device, counts.dtype, *shape, places, *map(aligned, tensors)),
                               (programs, 1, 1), (*tensors, rank, *sizes, *chunks[:2], capacity, *shape, places),
                               dict(num_warps=4 if counts.is_cuda else 1))
    return tables


# The layout's kernels are on the host's path to the first expert GEMM: launched through their compiled binaries
# (fused_dlrm.kernels.launch), keyed on their constexprs, device and tensors' alignment.
_ROWS_LAUNCHES = CompiledLaunches(_expert_rows_kernel)
_TILE_LAUNCHES = CompiledLaunches(_tile_tables_kernel)


def gather_counts(tokens_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's rows per global expert -> C [world, num_experts] (an all-gather; itself in one process)."""
    return _all_gather_rows(tokens_per_expert, group)


def gather_counts_and_words(tokens_per_expert: torch.Tensor, words: torch.Tensor,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`gather_counts`, with this rank's `words` (int64 [n], on the counts' device) riding in the same all-gather ->
    [world, num_experts + n]: C, then every rank's words (moe.layer: its refusal words)."""
    return _all_gather_rows(torch.cat([tokens_per_expert, words]), group)


def _all_gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[n] on every rank -> [world, n] (an all-gather; itself in one process)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return row.view(1, -1)
    world = dist.get_world_size(group)
    out = row.new_empty(world * row.numel())  # flat: gloo checks the sizes
    dist.all_gather_into_tensor(out, row.contiguous(), group=group)
    return out.view(world, -1)
