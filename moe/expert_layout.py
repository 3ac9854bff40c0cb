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
which `moe.permute.unpermute` consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import triton
import triton.language as tl


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


def build_expert_layout(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: int,
                        owner_tile_rows: int) -> ExpertLayout:
    """counts: int64 [world, num_experts] on any device; the layout's tensors live on that device. `tile_rows`,
    `owner_tile_rows`: the row tiles of the combine's GEMM and of the dispatch's backward GEMM. Reading the
    counts is the one host sync of a fused MoE layer. The host derives, in numpy, the sizes and the receive
    blocks' starts that the small tile tables need; the per-row tables come from the counts on the device, in one
    kernel (no copy from the host: the host's time per layer is what the fused layer is short of)."""
    world, num_experts = counts.shape
    if num_experts != world * num_local_experts:
        raise ValueError(f"counts has {num_experts} experts; expected {world} ranks x {num_local_experts}")
    counts = counts.contiguous()  # kernels read it whole
    c = counts.cpu().numpy()
    # owner_blocks[d]: [L, world] counts in receive order (every owner's: the buffers are sized by the largest).
    owner_blocks = c.reshape(world, world, num_local_experts).transpose(1, 2, 0).reshape(world, -1)
    my_blocks = owner_blocks[rank]
    tables = expert_rows(counts, rank, num_local_experts, (tile_rows, owner_tile_rows), int(c[rank].sum()),
                         int(my_blocks.sum()))
    return ExpertLayout(
        counts=counts, host_counts=c, rank=rank, world=world, num_local_experts=num_local_experts,
        send_dest_rank=tables[0], send_dest_row=tables[1], send_tile=tables[2], tile_rows=tile_rows,
        send_owner_tile=tables[3], owner_tile_rows=owner_tile_rows,
        recv_offsets=np.concatenate([[0], np.cumsum(my_blocks)]), recv_source_rank=tables[4],
        recv_source_row=tables[5],
        tokens_per_local_expert=my_blocks.reshape(num_local_experts, world).sum(axis=1).tolist(),
        max_recv_rows=int(owner_blocks.sum(axis=1).max()), max_send_rows=int(c.sum(axis=1).max()))


@triton.jit(do_not_specialize=["rank", "num_sent", "num_received", "send_programs"])  # one variant for all steps
def _expert_rows_kernel(counts_ptr, send_rank_ptr, send_row_ptr, send_tile_ptr, send_owner_tile_ptr, recv_rank_ptr,
                        recv_row_ptr, rank, num_sent, num_received, send_programs, WORLD: tl.constexpr,
                        L: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr, TILE_ROWS: tl.constexpr,
                        OWNER_TILE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Programs [0, send_programs): BLOCK of this rank's permuted rows each; the rest: BLOCK of its received rows.
    A row finds its run (an expert's rows on the source side, a block on the owner side) by comparing its index
    with the runs' ends; a run's values come from the counts, which every program reads whole ([world, E])."""
    E: tl.constexpr = WORLD * L
    pid = tl.program_id(0)
    g = tl.arange(0, E_P2)  # global expert, or the owner's block (local expert g // WORLD, source g % WORLD)
    s = tl.arange(0, W_P2)
    if pid < send_programs:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        mine = tl.load(counts_ptr + rank * E + g, mask=g < E, other=0).to(tl.int32)
        first = tl.cumsum(mine, axis=0) - mine  # of expert g's rows
        expert = tl.sum((first + mine <= i[:, None]).to(tl.int32), axis=1)  # the first run not ended before i
        hit = g[None, :] == expert[:, None]
        within = i - tl.sum(tl.where(hit, first[None, :], 0), axis=1)
        owner = expert // L
        # Block (local expert, rank) of its owner starts after the owner's rows of earlier local experts and
        # after the rows of this expert from earlier sources.
        c = tl.load(counts_ptr + s[:, None] * E + g[None, :], mask=(s[:, None] < WORLD) & (g[None, :] < E),
                    other=0).to(tl.int32)
        rows_of_expert = tl.sum(c, axis=0)
        from_earlier_sources = tl.sum(tl.where(s[:, None] < rank, c, 0), axis=0)
        earlier = (g[None, :] // L == owner[:, None]) & (g[None, :] < expert[:, None])  # the owner's experts before
        in_expert = tl.sum(tl.where(hit, from_earlier_sources[None, :], 0), axis=1) + within  # owner's row - expert's
        tiles = (mine + TILE_ROWS - 1) // TILE_ROWS
        first_tile = tl.sum(tl.where(hit, (tl.cumsum(tiles, axis=0) - tiles)[None, :], 0), axis=1)
        owner_tiles = (rows_of_expert + OWNER_TILE_ROWS - 1) // OWNER_TILE_ROWS
        ok = i < num_sent
        tl.store(send_rank_ptr + i, owner.to(tl.int64), mask=ok)
        tl.store(send_row_ptr + i, (tl.sum(tl.where(earlier, rows_of_expert[None, :], 0), axis=1)
                                    + in_expert).to(tl.int64), mask=ok)
        tl.store(send_tile_ptr + i, (first_tile + within // TILE_ROWS).to(tl.int64), mask=ok)
        tl.store(send_owner_tile_ptr + i, (tl.sum(tl.where(earlier, owner_tiles[None, :], 0), axis=1)
                                           + in_expert // OWNER_TILE_ROWS).to(tl.int64), mask=ok)
    else:
        j = (pid - send_programs) * BLOCK + tl.arange(0, BLOCK)
        size = tl.load(counts_ptr + (g % WORLD) * E + rank * L + g // WORLD, mask=g < E, other=0).to(tl.int32)
        first = tl.cumsum(size, axis=0) - size
        block = tl.sum((first + size <= j[:, None]).to(tl.int32), axis=1)
        within = j - tl.sum(tl.where(g[None, :] == block[:, None], first[None, :], 0), axis=1)
        source = block % WORLD
        ok = j < num_received
        # The source's permuted rows of the expert start after its rows of earlier experts.
        rows_before = tl.load(counts_ptr + source[:, None] * E + g[None, :],
                              mask=ok[:, None] & (g[None, :] < rank * L + block[:, None] // WORLD), other=0)
        tl.store(recv_rank_ptr + j, source.to(tl.int64), mask=ok)
        tl.store(recv_row_ptr + j, tl.sum(rows_before.to(tl.int32), axis=1).to(tl.int64) + within, mask=ok)


def expert_rows(counts: torch.Tensor, rank: int, num_local_experts: int, tile_rows: tuple[int, int], num_sent: int,
                num_received: int) -> list[torch.Tensor]:
    """The per-row tables on counts' device: [send_dest_rank, send_dest_row, send_tile, send_owner_tile] of this
    rank's permuted rows (tile_rows: the source's tiles, the owner's) and [recv_source_rank, recv_source_row] of
    its received rows (int64), views of one buffer, each starting on a 16-byte boundary: Triton specialises
    pointers on that alignment, and a changing one would compile kernels anew in the middle of training."""
    world, num_experts = counts.shape
    sent, received = _even(num_sent), _even(num_received)
    flat = torch.empty(4 * sent + 2 * received, dtype=torch.int64, device=counts.device)
    tables = [flat[k * sent:k * sent + num_sent] for k in range(4)]
    tables += [flat[4 * sent + k * received:4 * sent + k * received + num_received] for k in range(2)]
    e_p2 = triton.next_power_of_2(num_experts)
    block = max(16, min(128, 8192 // e_p2))  # [block, experts] intermediates
    send_programs = triton.cdiv(num_sent, block)
    programs = send_programs + triton.cdiv(num_received, block)
    if programs:
        _expert_rows_kernel[(programs,)](
            counts.contiguous(), *tables, rank, num_sent, num_received, send_programs, WORLD=world,
            L=num_local_experts, W_P2=triton.next_power_of_2(world), E_P2=e_p2, TILE_ROWS=tile_rows[0],
            OWNER_TILE_ROWS=tile_rows[1], BLOCK=block,
            num_warps=4 if counts.is_cuda else 1)
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


def gather_counts(tokens_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's rows per global expert -> C [world, num_experts] (an all-gather; itself in one process)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tokens_per_expert.view(1, -1).clone()
    world = dist.get_world_size(group)
    out = tokens_per_expert.new_empty(world * tokens_per_expert.numel())  # flat: gloo checks the sizes
    dist.all_gather_into_tensor(out, tokens_per_expert.contiguous(), group=group)
    return out.view(world, -1)
