"""The MoE combine fused with the second expert GEMM: each output tile goes straight to its token's source rank.

Owner side (`start`): a persistent grouped GEMM out = h @ w2[e] over the rows this rank's experts received
(grouped by local expert, then source rank: moe.expert_layout's receive order). A tile is BLOCK_M rows of one
(local expert, source) block by BLOCK_N columns, so all its rows belong to one source; it is stored at
`recv_source_row` of that source's symmetric combine buffer (the source's permuted-row order, zero-copy), then
the tile's ready flag in the source's flag buffer is raised (release, system scope). Tiles for remote sources
come first, rotated by rank (peer_tiles.remote_first_order); this rank's own tiles last.

Source side (`finish`): a weighted-unpermute kernel; each program takes a block of tokens x BLOCK_N columns,
waits (bounded) for the flags of exactly the tiles that hold its tokens' k rows, and sums weight * row in
assignment order in fp32 (deterministic). A small kernel then acknowledges the epoch to every owner.

Flags: source s numbers the owner tiles that hold its rows by (global expert g, row block i of its C[s, g] rows):
slot = sum_{g' < g} cdiv(C[s, g'], BLOCK_M) + i, times the column blocks. Every rank knows C, so both sides agree.
Flags carry the epoch and are compared with `>=`. Guard: an owner stores a tile of epoch E for source s only once
s has acknowledged E - 1, i.e. its consumer finished reading the previous rows and saw all its flags; so one
combine buffer suffices (the consumer reads it, the result is a fresh tensor) and no flag of E can be mistaken
for one of E - 1 by a slot that another owner used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import PeerBuffer, _Workspace
from fused_dlrm.kernels.peer_flags import PeerErrors, consumer_released, signal_ready
from fused_dlrm.kernels.peer_tiles import remote_first_order
from moe.expert_layout import ExpertLayout
from moe.permute import Permutation, unpermute

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass
class CombinePlan:
    """One epoch's addresses, derived from the layout's counts: what `prepare` computes ahead of the kernels."""

    layout: ExpertLayout
    dtype: torch.dtype
    rows: PeerBuffer  # the combine buffer: this rank's permuted rows, written by their owners
    ready: PeerBuffer  # int32 flags, per (flag slot, column block)
    ack: PeerBuffer  # int32 [world]: the epoch each source has finished reading
    tiles: torch.Tensor  # int64 [6, row tiles] of the owner GEMM (see FusedCombine._owner_tiles)
    tile_of_row: torch.Tensor  # int64 [this rank's permuted rows]: flag slot of the tile holding each row


@dataclass(frozen=True)
class CombineBlocks:
    """Tile shapes of both kernels; BLOCK_M and BLOCK_N also define the flag slots, so every rank uses the same."""

    block_m: int
    block_n: int
    block_k: int
    gemm_warps: int
    gemm_stages: int
    block_tokens: int
    consumer_warps: int


def combine_blocks(device: torch.device) -> CombineBlocks:
    if device.type == "cuda":  # bf16 tensor-core tiles for H100/H200
        return CombineBlocks(128, 128, 64, 8, 3, 16, 4)
    return CombineBlocks(16, 16, 16, 1, 1, 8, 1)  # the interpreter: small tiles, small test shapes


def fused_combine_reference(hs: list[torch.Tensor], w2s: list[torch.Tensor], layouts: list[ExpertLayout],
                            perms: list[Permutation], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole world in float64: owner d's expert outputs h_d @ w2_d[e] go back to their sources' permuted rows,
    which each source unpermutes with its routing weights. Returns every rank's [tokens, d_model]."""
    d_model = w2s[0].shape[-1]
    combined = [torch.full((lay.send_dest_row.numel(), d_model), float("nan"), dtype=torch.float64)
                for lay in layouts]
    for h, w2, lay in zip(hs, w2s, layouts):
        out = torch.cat([rows.double() @ w2[e].double()
                         for e, rows in enumerate(torch.split(h, lay.tokens_per_local_expert))])
        for s in range(lay.world):
            mine = lay.recv_source_rank.cpu() == s
            combined[s][lay.recv_source_row.cpu()[mine]] = out[mine]
    return [unpermute(rows, perm, w.double()) for rows, perm, w in zip(combined, perms, weights)]


@triton.jit(do_not_specialize=["num_row_tiles", "epoch", "spin_limit"])  # one variant for all steps
def _expert_down_kernel(h_ptr, w2_ptr, tiles_ptr, out_ptrs, ready_ptrs, ack_ptr, error_ptr,
                        num_row_tiles, num_programs, epoch, spin_limit,
                        FFN: tl.constexpr, D_MODEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Persistent: tiles pid, pid + P, ... of (row tile, column block); the tile table is remote-first."""
    N_COL: tl.constexpr = (D_MODEL + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    t = pid
    while t < num_row_tiles * N_COL:
        tile = t // N_COL
        col = t % N_COL
        # tile table rows: first h row, row count, local expert, source rank, first source row, flag slot
        h_row = tl.load(tiles_ptr + tile)
        count = tl.load(tiles_ptr + num_row_tiles + tile)
        expert = tl.load(tiles_ptr + 2 * num_row_tiles + tile)
        dest = tl.load(tiles_ptr + 3 * num_row_tiles + tile)
        dest_row = tl.load(tiles_ptr + 4 * num_row_tiles + tile)
        slot = tl.load(tiles_ptr + 5 * num_row_tiles + tile)
        cols = col * BLOCK_N + n
        row_mask = m < count
        col_mask = cols < D_MODEL
        a_ptrs = h_ptr + (h_row + m)[:, None] * FFN + ks[None, :]
        b_ptrs = w2_ptr + expert * (FFN * D_MODEL) + ks[:, None] * D_MODEL + cols[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, FFN, BLOCK_K):
            k_mask = (k0 + ks) < FFN
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * D_MODEL
        # The guard, as late as possible: the source has finished reading the previous epoch's rows.
        released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
        out = tl.multiple_of(tl.load(out_ptrs + dest).to(tl.pointer_type(OUT_DTYPE)), 16)  # aligned: vector stores
        out_ptr = out + (dest_row + m)[:, None] * D_MODEL + cols[None, :]
        tl.store(out_ptr, acc.to(OUT_DTYPE), mask=row_mask[:, None] & col_mask[None, :] & released)
        if released:
            flag = tl.load(ready_ptrs + dest).to(tl.pointer_type(tl.int32)) + slot * N_COL + col
            tl.debug_barrier()  # every thread's stores of the tile before the flag
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
        t += num_programs


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "epoch", "spin_limit"])  # one variant for all steps
def _weighted_unpermute_kernel(rows_ptr, inverse_ptr, weights_ptr, tile_of_row_ptr, owner_of_row_ptr, ready_ptr,
                               error_ptr, out_ptr, copy_ptr, num_tokens, num_rows, epoch, spin_limit,
                               D_MODEL: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               COPY_ROWS: tl.constexpr):
    """Program (token block, column block): wait for the tiles holding its rows, then the weighted sum; with
    COPY_ROWS also a copy of each row it read (every kept row is read by exactly one assignment)."""
    N_COL: tl.constexpr = (D_MODEL + BLOCK_N - 1) // BLOCK_N
    col = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    js = tl.arange(0, K_P2)
    assignment = tokens[:, None] * TOP_K + js[None, :]
    row = tl.load(inverse_ptr + assignment, mask=token_mask[:, None] & (js[None, :] < TOP_K), other=num_rows)
    kept = row < num_rows  # dropped assignments point one past the last row
    slot = tl.load(tile_of_row_ptr + row, mask=kept, other=0) * N_COL + col
    seen = tl.atomic_add(ready_ptr + slot, tl.zeros([BLOCK_T, K_P2], tl.int32), mask=kept, sem="acquire",
                         scope="sys")
    seen = tl.where(kept, seen, epoch)
    spins = 0
    while (tl.min(tl.min(seen, axis=1), axis=0) < epoch) & (spins < spin_limit):
        seen = tl.atomic_add(ready_ptr + slot, tl.zeros([BLOCK_T, K_P2], tl.int32), mask=kept, sem="acquire",
                             scope="sys")
        seen = tl.where(kept, seen, epoch)
        spins += 1
    late = seen < epoch
    if tl.max(tl.max(late.to(tl.int32), axis=1), axis=0) > 0:
        first = tl.min(tl.min(tl.where(late, assignment, 2147483647), axis=1), axis=0)
        late_row = tl.min(tl.min(tl.where(assignment == first, row, 2147483647), axis=1), axis=0)
        tl.store(error_ptr + 1, tl.load(owner_of_row_ptr + late_row).to(tl.int32))
        tl.store(error_ptr + 2, tl.min(tl.min(tl.where(assignment == first, slot, 2147483647), axis=1), axis=0))
        tl.atomic_xchg(error_ptr, 1)
    tl.debug_barrier()  # the flags this program's threads acquired cover the rows any of them reads
    cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D_MODEL
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # assignment order: the same sum on every run
        r = tl.load(inverse_ptr + tokens * TOP_K + j, mask=token_mask, other=num_rows)
        ok = token_mask & (r < num_rows)
        w = tl.load(weights_ptr + tokens * TOP_K + j, mask=ok, other=0.0)
        at = r[:, None] * D_MODEL + cols[None, :]
        x = tl.load(rows_ptr + at, mask=ok[:, None] & col_mask[None, :], other=0.0,
                    cache_modifier=".cg")  # peers wrote these rows: not from L1
        if COPY_ROWS:
            tl.store(copy_ptr + at, x, mask=ok[:, None] & col_mask[None, :])
        acc += x.to(tl.float32) * w[:, None]
    tl.store(out_ptr + tokens[:, None] * D_MODEL + cols[None, :], acc.to(OUT_DTYPE),
             mask=token_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["epoch"])  # one variant for all steps
def _acknowledge_kernel(ack_ptrs, rank, epoch, WORLD: tl.constexpr):
    signal_ready(ack_ptrs, rank, epoch, WORLD)


class FusedCombine:
    """Expert GEMM 2 + the combine all-to-all + the weighted unpermute, on a symmetric workspace.

    Every rank calls `start` (owner side) and then `finish` (source side) once per epoch, in the same order;
    in a simulated world every rank's `start` runs before any `finish`.
    """

    def __init__(self, workspace: _Workspace, d_model: int, num_local_experts: int, num_programs: int,
                 spin_limit: int):
        self.ws = workspace
        self.rank, self.world = workspace.rank, workspace.world_size
        self.d_model, self.num_local_experts = d_model, num_local_experts
        self.num_programs, self.spin_limit = num_programs, spin_limit
        self.blocks = combine_blocks(workspace.device)
        self.num_col = triton.cdiv(d_model, self.blocks.block_n)
        self.errors = PeerErrors(workspace.device, self.rank, "fused MoE combine")
        self._plan: CombinePlan | None = None

    def prepare(self, layout: ExpertLayout, dtype: torch.dtype) -> CombinePlan:
        """The epoch's buffers (allocated or grown: collective on GPUs) and tile tables, from the counts on the
        host. `start` and `finish` call it for their layout; calling it earlier, while the host has the counts
        anyway (before the dispatch), keeps host work and syncs out of the way of the kernels."""
        if self._plan is not None and self._plan.layout is layout and self._plan.dtype == dtype:
            return self._plan
        counts = layout.counts.cpu()
        rows, ready, ack = self._buffers(counts, dtype)
        tiles = self._owner_tiles(counts).to(self.ws.device)
        self._plan = CombinePlan(layout, dtype, rows, ready, ack, tiles, self._tile_of_row(layout))
        return self._plan

    def start(self, h: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout) -> int:
        """h [received rows, ffn] in receive order, w2 [local experts, ffn, d_model] (h's dtype): enqueue the GEMM
        whose tiles land in their sources' combine buffers. Returns the epoch to pass to `finish`."""
        self.errors.check()
        if w2.shape != (self.num_local_experts, h.shape[1], self.d_model) or w2.dtype != h.dtype:
            raise ValueError(f"w2 {tuple(w2.shape)} {w2.dtype} does not fit h {tuple(h.shape)} {h.dtype}")
        if h.shape[0] != sum(layout.tokens_per_local_expert):
            raise ValueError(f"h has {h.shape[0]} rows; the layout gives {sum(layout.tokens_per_local_expert)}")
        plan = self.prepare(layout, h.dtype)
        epoch = self.ws.next_epoch("combine")
        num_row_tiles = plan.tiles.shape[1]
        if num_row_tiles:
            b = self.blocks
            grid = min(self.num_programs, num_row_tiles * self.num_col)
            # fp32 tiles on GPUs: half the k step and two stages, to fit in shared memory
            block_k, stages = (32, 2) if h.is_cuda and h.dtype == torch.float32 else (b.block_k, b.gemm_stages)
            _expert_down_kernel[(grid,)](
                h.contiguous(), w2.contiguous(), plan.tiles, plan.rows.peer_ptrs, plan.ready.peer_ptrs,
                plan.ack.local, self.errors.word, num_row_tiles, grid, epoch, self.spin_limit,
                FFN=h.shape[1], D_MODEL=self.d_model, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=block_k,
                OUT_DTYPE=TL_DTYPES[h.dtype], PRECISION="ieee" if h.dtype == torch.float32 else None,
                num_warps=b.gemm_warps, num_stages=stages)
        return epoch

    def finish(self, epoch: int, layout: ExpertLayout, perm: Permutation, weights: torch.Tensor,
               rows_out: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, d_model] in h's dtype: per token the weighted sum (fp32) of its k expert outputs, each block
        of tokens read as soon as the owners' flags of its rows are up. `rows_out` ([this rank's permuted rows,
        d_model], h's dtype), if given, receives the expert output rows (the routing weights' gradient needs
        them; the combine buffer itself is the owners' again once `finish` acknowledges the epoch)."""
        if self._plan is None or self._plan.layout is not layout:
            raise RuntimeError("finish must follow start with the same layout")
        plan = self._plan
        num_tokens, top_k = weights.shape
        if rows_out is not None and (rows_out.shape != (layout.send_dest_rank.numel(), self.d_model)
                                     or rows_out.dtype != plan.dtype or not rows_out.is_contiguous()):
            raise ValueError(f"rows_out must be a contiguous [{layout.send_dest_rank.numel()}, {self.d_model}] "
                             f"{plan.dtype} tensor, got {tuple(rows_out.shape)} {rows_out.dtype}")
        out = torch.empty(num_tokens, self.d_model, dtype=plan.dtype, device=weights.device)
        if num_tokens:
            b = self.blocks
            grid = (triton.cdiv(num_tokens, b.block_tokens), self.num_col)
            _weighted_unpermute_kernel[grid](
                plan.rows.local, perm.inverse, weights.float().contiguous(), plan.tile_of_row,
                layout.send_dest_rank, plan.ready.local, self.errors.word, out,
                out if rows_out is None else rows_out, num_tokens, layout.send_dest_rank.numel(), epoch,
                self.spin_limit,
                D_MODEL=self.d_model, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
                BLOCK_T=b.block_tokens, BLOCK_N=b.block_n, OUT_DTYPE=TL_DTYPES[plan.dtype],
                COPY_ROWS=rows_out is not None, num_warps=b.consumer_warps)
        _acknowledge_kernel[(1,)](plan.ack.peer_ptrs, self.rank, epoch, WORLD=self.world)
        self.errors.after_wait(epoch)
        return out

    def _buffers(self, counts: torch.Tensor, dtype: torch.dtype):
        """The combine rows, the flags and the acks, sized from C alone (so every rank asks for the same)."""
        max_rows = int(counts.sum(dim=1).max())
        slots = int(triton.cdiv(counts, self.blocks.block_m).sum(dim=1).max())
        # Grown in steps of about 1/8 so that changing loads rarely re-allocate (a collective on GPUs).
        rows = self.ws.buffer("combine_rows", _round_up(max_rows) * self.d_model, dtype)
        # Flags are never reset, so a larger flag buffer is a new one; zeros read as "not ready" for any epoch.
        slots = triton.next_power_of_2(max(slots, 1))
        ready = self.ws.buffer(f"combine_ready_{slots}", slots * self.num_col, torch.int32)
        ack = self.ws.buffer("combine_ack", self.world, torch.int32)
        return rows, ready, ack

    def _owner_tiles(self, counts: torch.Tensor) -> torch.Tensor:
        """int64 [6, row tiles]: first h row, rows, local expert, source, first source row, flag slot; tiles of
        remote sources first (rotated by rank), then this rank's own."""
        bm, world, local = self.blocks.block_m, self.world, self.num_local_experts
        blocks = counts[:, self.rank * local:(self.rank + 1) * local].t().reshape(-1)  # receive order (e, s)
        recv_offsets = torch.cumsum(blocks, 0) - blocks
        tiles_per = triton.cdiv(counts, bm)  # [source, global expert]
        slot_base = torch.cumsum(tiles_per, 1) - tiles_per
        source_start = torch.cumsum(counts, 1) - counts
        sources = torch.tensor(remote_first_order(self.rank, world)).repeat_interleave(local)
        experts = torch.arange(local).repeat(world)
        g = self.rank * local + experts
        n = tiles_per[sources, g]
        i = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        rep = lambda v: torch.repeat_interleave(v, n)  # noqa: E731
        first_h = rep(recv_offsets[experts * world + sources]) + i * bm
        count = torch.clamp(rep(counts[sources, g]) - i * bm, max=bm)
        return torch.stack([first_h, count, rep(experts), rep(sources), rep(source_start[sources, g]) + i * bm,
                            rep(slot_base[sources, g]) + i])

    def _tile_of_row(self, layout: ExpertLayout) -> torch.Tensor:
        """int64 [this rank's permuted rows]: the flag slot (without the column block) of each row's tile; on the
        layout's device, without a host sync."""
        mine = layout.counts[self.rank]
        num_rows = layout.send_dest_rank.numel()
        tiles_per = triton.cdiv(mine, self.blocks.block_m)
        starts = torch.cumsum(mine, 0) - mine
        expert = torch.repeat_interleave(torch.arange(mine.numel(), device=mine.device), mine, output_size=num_rows)
        within = torch.arange(num_rows, device=mine.device) - starts[expert]
        return (torch.cumsum(tiles_per, 0) - tiles_per)[expert] + within // self.blocks.block_m


def _round_up(rows: int) -> int:
    step = max(1, 1 << max(0, rows.bit_length() - 4))
    return max(1, triton.cdiv(rows, step) * step)
