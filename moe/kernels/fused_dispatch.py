"""The MoE dispatch fused with the first expert GEMM: rows are pushed into the owners' symmetric buffers, and the
owner's persistent grouped GEMM waits, tile by tile, for just the rows it reads.

Push (`FusedDispatch.start`, every source): persistent programs walk units (destination rank d, chunk c), where
chunk c is receive rows [c * block_m, (c + 1) * block_m) of d's buffer; destinations remote first, rotated by rank
(peer_tiles.remote_first_order), this rank last. A unit gathers the source's permuted rows that land in that
chunk (row i is x[token_of_row[i]]: no permuted copy is made) and stores each at row `tables.send_dest_row[i]`
of d's receive buffer, then raises flag (source rank, c) in d's flag buffer.

Both halves read moe.expert_layout.DispatchTables, which kernels make from the all-gathered counts on the device:
the host launches the push and the GEMM without reading the counts (it reads them while the GEMM runs, for the
combine and the backward). The tables cover the receive capacity that `reserve` set from earlier calls' counts;
rows past it are neither pushed nor computed, and the caller, who sees ExpertLayout.max_recv_rows afterwards,
reserves more and dispatches again.

Ready rule (what the owner derives from the counts alone): receive row j of the owner is ready once flag
(tables.recv_source_rank[j], j // block_m) holds the epoch. A source raises flag (s, c) only in the owner whose
chunk c holds its rows, after storing all of them (a source's rows to one owner are increasing in its receive
rows, so the rows of one unit are a contiguous range of the source's permuted rows).

GEMM (`FusedDispatch.finish`, every owner): tiles of [BLOCK_M rows of one local expert] x [BLOCK_N of ffn];
expert e's rows are recv_offsets[e * world] .. recv_offsets[(e + 1) * world]. A tile reads this rank's own rows
straight from x (no wait: the push copies them into the buffer only for `received`) and polls (bounded) the flags
of its other rows, then computes h = silu(x @ w1[e]) * (x @ w3[e]) with both products sharing the A tile (fp32
accumulation); w1 and w3 are the column halves of the experts' w13 [L, d_model, 2 * ffn], read in place.
Persistent programs take tiles from a counter, row tiles in walk order (grouped: moe.kernels.tile_order): tiles
whose rows all came from this rank first, then by the source whose rows arrive last (rank - 1 pushes to this rank
first). On GPUs the push runs on a side
stream, so the GEMM overlaps it; the GEMM leaves PUSH_SMS SMs free, so that the pushes the peers wait for always
find room, and PUSH_SMS more programs of it wait behind the push on the push's stream, taking tiles from the same
counter once the push is done. After the GEMM a one-program kernel acknowledges the epoch to every source.

Dispatch by token (`max_tokens`): with top_k experts over few ranks a token often has several experts on one
rank, and its row then crosses the link once per expert. By token, each source stores each token once into every
peer that owns an expert it chose, at [source, token] of that peer's token buffer (max_tokens slots per source,
double-buffered by epoch parity), together with the token of each of its permuted rows bound there (an int32 id
buffer [source, permuted row]); unit (peer, c) moves tokens [c * block_m, (c + 1) * block_m) and a slice of the ids,
then raises flag (source, c) in the peer (`_push_tokens_kernel`). GEMM 1 reads a peer's row j as token ids[source,
source row] of the token buffer, once every unit flag of the row's source holds the epoch (a tile's rows may be
any of the source's tokens; this rank's own tiles go first and hide the wait). `received` is then not a buffer the
push fills: when training, GEMM 1's first column block stores the rows it read (`rows_out`). The guard (acks) is
the same.

Backward (`start_backward` on the owner, `finish_backward` on the source): a13 = x @ w13[e], which the forward GEMM
stores when training (`finish(a13_out=...)`; recomputed otherwise), gives da13 = [da1 | da3] in one kernel
(moe.kernels.swiglu_backward) and dw13 = x_e^T @ da13_e (torch); a persistent GEMM (operands through TMA:
moe.kernels.tma_tiles) computes dx tiles = da13 @ w13[e]^T (= da1 @ w1[e]^T + da3 @ w3[e]^T: one k loop over 2 *
ffn), tiles holding rows of remote sources first (rank + 1 first), stores each row at its source's permuted row in
the source's gradient buffer and raises flag (owner, row tile, column block) in every rank. Each source knows from C
which owner tile holds each of its rows, and sums every token's kept rows as their flags come up (FusedCombine's
consumer kernel with unit weights); it then acknowledges the epoch to the owners, who wait for that before the next
store.

Guards: receive rows are double-buffered by epoch parity, and a source stores epoch e only after the owner has
acknowledged epoch e - 1 (peer_flags.consumer_released): the `received` view that `finish` returns stays valid
until the next `finish` call. Flags carry epochs and are never reset; the receive capacity (and with it the flag
buffer) only grows, with room to spare, the same on every rank (`reserve`: expert_layout.receive_capacity).
The host counts a forward epoch at its `end`, the device at the acknowledgement: a call refused before its push
(every check comes first) takes no epoch; one whose push went out but whose GEMM 1 did not (refused at `finish`, or
an error) stays in flight, and every later call is refused until `finish` completes it. The backward takes its
epoch once its checks passed (an epoch never acknowledged would stall every later backward's guard).

After a wait gave up (PeerWaitTimeout): the rank that gave up still acknowledges the epoch (its reads are over),
and a push that gave up waiting for an owner's acknowledgement stores nothing and raises no flag there (the owner
would read its buffer's rows of the epoch before last as this epoch's): that owner's wait times out too, naming
this rank. So a peer that was only late finishes the epoch exactly, and the next epoch every rank calls is exact.
(A source late by a bound whose owner then runs on without its rows for two epochs could land that epoch's rows
among the next-but-one's of other sources; MoELayer's calls cannot: each begins with the counts' all-gather, which
waits for every rank.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import _Workspace
from fused_dlrm.kernels import TL_DTYPES, dot_precision
from fused_dlrm.kernels.launch import CompiledLaunches, aligned
from fused_dlrm.kernels.peer_flags import (PeerErrors, consumer_released, poll_ready, record_refused, record_timeout,
                                           signal_peer, signal_ready, wait_at_least)
from fused_dlrm.kernels.peer_tiles import remote_first_order
from fused_dlrm.kernels.tma import descriptor, require_tma_readable
from moe.expert_layout import DispatchTables, ExpertLayout, receive_capacity
from moe.experts import _grouped_mm_works, group_ends, grouped_weight_grad, swiglu
from moe.kernels.fused_combine import _weighted_unpermute_kernel
from moe.kernels.swiglu_backward import swiglu_backward
from moe.kernels.tile_order import grouped_tile
from moe.kernels.tma_tiles import transposed_weight_tile
from moe.permute import Permutation

PUSH_TILE_ELEMENTS = 8192  # elements a push program moves per step ([block_m, BLOCK_D]): 16-byte stores, no spills
PUSH_SMS = 16  # SMs the GEMM leaves free for this rank's push, which runs beside it (see `_gemm_programs`)


# -- references ---------------------------------------------------------------------------------------------------
def dispatch_reference(xs: list[torch.Tensor], token_of_rows: list[torch.Tensor], counts: torch.Tensor,
                       owner: int, num_local_experts: int) -> torch.Tensor:
    """The rows `owner` receives: for each local expert e, for each source s, the rows s routed to expert
    owner * L + e, in s's permuted order (the bulk layer's all-to-all + regroup)."""
    blocks = []
    for e in range(owner * num_local_experts, (owner + 1) * num_local_experts):
        for s, (x, tokens) in enumerate(zip(xs, token_of_rows)):
            first = int(counts[s, :e].sum())
            blocks.append(x[tokens[first:first + int(counts[s, e])]])
    return torch.cat(blocks) if blocks else xs[0].new_zeros(0, xs[0].shape[1])


def gated_gemm_reference(received: torch.Tensor, tokens_per_local_expert: list[int],
                         w13: torch.Tensor) -> torch.Tensor:
    """silu(x @ w1[e]) * (x @ w3[e]) for each local expert's contiguous rows (the SwiGLU experts' first half),
    w13 = [w1 | w3]."""
    outs = [swiglu(x @ w13[e]) for e, x in enumerate(torch.split(received, tokens_per_local_expert))]
    return torch.cat(outs) if outs else received.new_zeros(0, w13.shape[2] // 2)


def gated_gemm_grads(received: torch.Tensor, tokens_per_local_expert: list[int], w13: torch.Tensor,
                     dh: torch.Tensor, a13: torch.Tensor | None = None, weight_grad_dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(da13, dw13) for h = silu(a1) * a3, [a1 | a3] = a13 = x @ w13[e], given dh: a13 as the forward kept it, or
    recomputed; SwiGLU's backward is one kernel, dw13[e] = x_e^T @ da13_e (in weight_grad_dtype; None: the rows').
    The backward kernel turns da13 into dx."""
    if a13 is None:
        with torch.no_grad():
            a13 = _gate_up(received, tokens_per_local_expert, w13)
    da13 = swiglu_backward(a13, dh)
    return da13, grouped_weight_grad(received, da13, tokens_per_local_expert, weight_grad_dtype)


def _gate_up(x: torch.Tensor, sizes: list[int], w13: torch.Tensor) -> torch.Tensor:
    """x [rows, d_model] (expert e's rows contiguous) times w13[e]: torch._grouped_mm where the experts use it,
    else a loop."""
    if x.is_cuda and _grouped_mm_works(x.device, x.dtype, w13.shape[1], w13.shape[2] // 2):
        return torch._grouped_mm(x, w13, offs=group_ends(sizes, x.device))
    return torch.cat([rows @ w13[e] for e, rows in enumerate(torch.split(x, sizes))])


# -- push ---------------------------------------------------------------------------------------------------------
@triton.jit
def _x_rows(x_address_ptr, DTYPE: tl.constexpr):
    """This rank's tokens x, whose address `FusedDispatch.begin` stored on the device: a CUDA graph of the launches
    reads each call's x in place instead of a copy of it in the graph's own memory (begin checks the alignment)."""
    return tl.multiple_of(tl.load(x_address_ptr).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _unit_rows(counts_ptr, rank, dest, c, CHUNK: tl.constexpr, WORLD: tl.constexpr, L: tl.constexpr,
               W_P2: tl.constexpr, L_P2: tl.constexpr, E_P2: tl.constexpr):
    """Unit (owner dest, chunk c) of this rank's push: its permuted rows [lo, hi), from the counts C [world, E].
    Rows before `lo` go to owners before dest or land in dest below receive row c * CHUNK; this rank's rows of
    dest's local expert e are one block there, starting after dest's rows of earlier experts and after this
    expert's rows from earlier sources."""
    E: tl.constexpr = WORLD * L
    g = tl.arange(0, E_P2)
    earlier_owners = tl.sum(tl.load(counts_ptr + rank * E + g, mask=g < dest * L, other=0), axis=0)
    s = tl.arange(0, W_P2)[:, None]
    e = tl.arange(0, L_P2)[None, :]
    blocks = tl.load(counts_ptr + s * E + dest * L + e, mask=(s < WORLD) & (e < L), other=0)  # [source, expert]
    rows_of_expert = tl.sum(blocks, axis=0)
    start = tl.cumsum(rows_of_expert, axis=0) - rows_of_expert + tl.sum(tl.where(s < rank, blocks, 0), axis=0)
    mine = tl.sum(tl.where(s == rank, blocks, 0), axis=0)
    lo = earlier_owners + tl.sum(tl.minimum(tl.maximum(c * CHUNK - start, 0), mine), axis=0)
    hi = earlier_owners + tl.sum(tl.minimum(tl.maximum((c + 1) * CHUNK - start, 0), mine), axis=0)
    return lo, hi


@triton.jit(do_not_specialize=["chunks", "num_units", "num_programs", "spin_limit"])
def _push_rows_kernel(
    x_address_ptr, token_ptr, dest_row_ptr, counts_ptr, dest_order_ptr,  # where this rank's rows are (`_x_rows`),
    # C [world, E], owner order
    rows_ptrs, ready_ptrs, ack_ptr, error_ptr, epoch_ptr,  # peers' receive buffers and flag buffers, my acks, my
    # error word, the last epoch acknowledged (this call's is the next)
    rank, chunks, num_units, num_programs, spin_limit,  # chunks: per destination, its flags' stride
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, WORLD: tl.constexpr, L: tl.constexpr,
    W_P2: tl.constexpr, L_P2: tl.constexpr, E_P2: tl.constexpr, OWN_ROWS: tl.constexpr, X_DTYPE: tl.constexpr,
):
    """OWN_ROWS: also copy the rows this rank keeps into its own buffer (GEMM 1 reads them from x, waiting for no
    flag: only `received` needs them, for the training backward's weight gradient)."""
    x_ptr = _x_rows(x_address_ptr, X_DTYPE)
    epoch = tl.load(epoch_ptr) + 1
    row_base = (epoch % 2) * chunks * CHUNK  # the double buffer's half of this epoch
    pid = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_D)
    u = pid
    while u < num_units:  # `while`: the interpreter cannot range() from a program id
        dest = tl.load(dest_order_ptr + u // chunks)
        c = u % chunks
        if OWN_ROWS | (dest != rank):  # a unit of rows this rank keeps is left out without a look at the counts
            lo, hi = _unit_rows(counts_ptr, rank, dest, c, CHUNK, WORLD, L, W_P2, L_P2, E_P2)
            if hi > lo:
                rows = lo + lanes
                mask = rows < hi
                token = tl.load(token_ptr + rows, mask=mask, other=0).to(tl.int64)
                at = (row_base + tl.load(dest_row_ptr + rows, mask=mask, other=0)).to(tl.int64)
                released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
                mask = mask & released
                out = tl.load(rows_ptrs + dest).to(tl.pointer_type(x_ptr.dtype.element_ty))
                out = tl.multiple_of(out, 16)  # symmetric buffers are aligned: vector stores
                for k in range(0, D, BLOCK_D):
                    m = mask[:, None] & (k + cols < D)[None, :]
                    v = tl.load(x_ptr + token[:, None] * D + k + cols[None, :], mask=m)
                    tl.store(out + at[:, None] * D + k + cols[None, :], v, mask=m)
                # One flag, in the owner only (signal_peer; signal_ready raises a slot in every rank); none over
                # rows not stored (the owner's wait for them times out, naming this rank; it never reads the
                # rows of the epoch before last as this one's).
                if released:
                    signal_peer(ready_ptrs, dest, rank * chunks + c, epoch)
        u += num_programs


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "num_programs", "spin_limit"])
def _push_tokens_kernel(
    x_address_ptr, token_ptr, row_weight_ptr, inverse_ptr, counts_ptr, dest_order_ptr,  # where this rank's tokens
    # are (`_x_rows`), token_of_row, each permuted row's routing weight, each assignment's permuted row, C [world,
    # E], owner order
    tokens_ptrs, ids_ptrs, weights_ptrs, ready_ptrs, ack_ptr, error_ptr, epoch_ptr,  # peers' token, token-id
    # and row-weight buffers and unit flags, my acks, my error word, the last epoch acknowledged (this call's is
    # the next)
    rank, num_tokens, num_rows, num_programs, spin_limit,
    D: tl.constexpr, MAX_TOKENS: tl.constexpr, MAX_ROWS: tl.constexpr, CHUNK: tl.constexpr, IDS: tl.constexpr,
    UNITS: tl.constexpr, BLOCK_D: tl.constexpr, WORLD: tl.constexpr, L: tl.constexpr, TOP_K: tl.constexpr,
    K_P2: tl.constexpr, E_P2: tl.constexpr, X_DTYPE: tl.constexpr,
):
    """Dispatch by token: unit (peer d, c) stores tokens [c * CHUNK, (c + 1) * CHUNK) that chose an expert of d,
    each once, at [source = rank, token] of d's token buffer, and the token and routing weight of each of this
    rank's permuted rows [c * IDS, (c + 1) * IDS) that go to d at [rank, row] of d's id and weight buffers (the
    combine by token sums a token's rows on d with them); then it raises flag (rank, c) in d (none over a unit not
    stored). Peers only: GEMM 1 reads this rank's own rows from x."""
    x_ptr = _x_rows(x_address_ptr, X_DTYPE)
    epoch = tl.load(epoch_ptr) + 1
    slot = (epoch % 2) * WORLD + rank  # [half][source] of the peers' buffers
    E: tl.constexpr = WORLD * L
    g = tl.arange(0, E_P2)
    mine = tl.load(counts_ptr + rank * E + g, mask=g < E, other=0)  # my rows per global expert
    lanes = tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_D)
    k_lanes = tl.arange(0, K_P2)
    id_lanes = tl.arange(0, IDS)
    u = tl.program_id(0)
    while u < (WORLD - 1) * UNITS:  # `while`: the interpreter cannot range() from a program id
        dest = tl.load(dest_order_ptr + u // UNITS)  # the order lists the peers first, remote-first, rotated
        c = u % UNITS
        # My permuted rows for d's experts: [lo, hi) (rows are grouped by global expert, hence by owner).
        lo = tl.sum(tl.where(g < dest * L, mine, 0), axis=0)
        hi = lo + tl.sum(tl.where((g >= dest * L) & (g < (dest + 1) * L), mine, 0), axis=0)
        released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
        t = c * CHUNK + lanes
        rows_of = tl.load(inverse_ptr + t[:, None] * TOP_K + k_lanes[None, :],
                          mask=(t < num_tokens)[:, None] & (k_lanes < TOP_K)[None, :], other=-1)
        chose = tl.max(((rows_of >= lo) & (rows_of < hi)).to(tl.int32), axis=1) > 0  # a dropped one is past hi
        mask = (t < num_tokens) & chose & released
        out = tl.load(tokens_ptrs + dest).to(tl.pointer_type(x_ptr.dtype.element_ty))
        out = tl.multiple_of(out, 16)  # symmetric buffers are aligned: vector stores
        at = (slot * MAX_TOKENS + t).to(tl.int64)
        for k in range(0, D, BLOCK_D):
            m = mask[:, None] & (k + cols < D)[None, :]
            v = tl.load(x_ptr + t.to(tl.int64)[:, None] * D + k + cols[None, :], mask=m)
            tl.store(out + at[:, None] * D + k + cols[None, :], v, mask=m)
        r = c * IDS + id_lanes
        r_mask = (r >= lo) & (r < hi) & (r < num_rows) & released
        ids = tl.load(ids_ptrs + dest).to(tl.pointer_type(tl.int32)) + slot * MAX_ROWS
        tl.store(ids + r, tl.load(token_ptr + r, mask=r_mask, other=0).to(tl.int32), mask=r_mask)
        row_weights = tl.load(weights_ptrs + dest).to(tl.pointer_type(tl.float32)) + slot * MAX_ROWS
        tl.store(row_weights + r, tl.load(row_weight_ptr + r, mask=r_mask, other=0.0), mask=r_mask)
        if released:  # no flag over a unit not stored: the owner's wait for it times out, naming this rank
            signal_peer(ready_ptrs, dest, rank * UNITS + c, epoch)
        u += num_programs


# -- grouped gated GEMM -------------------------------------------------------------------------------------------
@triton.jit
def _poll(flags, mask, epoch, BLOCK: tl.constexpr):
    """The flags of a tile's rows (acquire); rows outside the mask count as ready (as `epoch`)."""
    seen = tl.atomic_add(flags, tl.zeros([BLOCK], flags.dtype.element_ty), mask=mask, sem="acquire", scope="sys")
    return tl.where(mask, seen, epoch)


@triton.jit
def _next_tile(next_ptr, num_tiles, claimants):
    """A program's next walk step from the counter, which `claimants` programs share (one launch's, or GEMM 1's
    two launches'). Each program claims steps until one lies past the end, so num_tiles + claimants claims are
    made; the last of them resets the counter for the next GEMM (stream order), which saves a fill per launch."""
    t = tl.atomic_add(next_ptr, 1)
    if t == num_tiles + claimants - 1:
        tl.atomic_xchg(next_ptr, 0)
    return t


@triton.jit
def _row_tile(t, tiles_ptr, width, num_row_tiles, col_blocks, BLOCK_M: tl.constexpr, ORDER: tl.constexpr):
    """Walk step t (in grouped order) -> (row tile id, its local expert, first row, rows, row mask, column block).
    tiles_ptr: gemm_tiles ([5, width], listing num_row_tiles: ExpertLayout's or DispatchTables'), whose row ORDER
    (3: arrival, 4: departure) is the walk."""
    position, col = grouped_tile(t, num_row_tiles, col_blocks)
    mt = tl.load(tiles_ptr + ORDER * width + position)
    expert = tl.load(tiles_ptr + mt)
    begin = tl.load(tiles_ptr + width + mt)
    rows = begin + tl.arange(0, BLOCK_M)
    return mt, expert, begin, rows, rows < tl.load(tiles_ptr + 2 * width + mt), col


@triton.jit(do_not_specialize=["tiles_width", "capacity", "flag_stride", "claimants", "spin_limit"])
def _gated_gemm_kernel(
    rows_ptr, x_address_ptr, token_ptr, w13_ptr, h_ptr, a13_ptr, rows_out_ptr,  # received rows (both halves; by
    # token: the token buffer), where this rank's tokens are (`_x_rows`) and token_of_row, [L, D, 2 * FFN] weights
    # (w1 columns, then w3), [rows, FFN] output, [rows, 2 * FFN] a13, [rows, D] the rows read (by token, training)
    tiles_ptr, tiles_width, row_tiles_ptr,  # the row tiles (DispatchTables.gemm_tiles; walked in arrival order)
    source_ptr, source_row_ptr, ready_ptr, ids_ptr, error_ptr, next_ptr, epoch_ptr,  # recv_source_rank/row, my
    # flags (by token: per source and unit), my token ids (by token), error, counter, the last epoch acknowledged
    # (this call's is the next)
    rank, capacity, flag_stride, claimants, spin_limit,  # flag_stride: flags per source (by token: units);
    # claimants: programs of the launches sharing next_ptr
    D: tl.constexpr, FFN: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, STORE_A13: tl.constexpr,
    BY_TOKEN: tl.constexpr, WORLD: tl.constexpr, MAX_TOKENS: tl.constexpr, MAX_ROWS: tl.constexpr,
    UNITS_P2: tl.constexpr,
):
    """BY_TOKEN: a peer's row is token ids[source, source row] of the token buffer's [source] block, ready once
    the flags of all `flag_stride` units (at most UNITS_P2) from that source hold the epoch; the rows read are
    stored into rows_out (col 0's tiles) when STORE_A13 (training: `received`). Else a peer's row is receive row
    `row`, ready once flag (source, row // CHUNK) holds the epoch."""
    x_ptr = _x_rows(x_address_ptr, rows_ptr.dtype.element_ty)
    epoch = tl.load(epoch_ptr) + 1
    n_tiles = tl.cdiv(FFN, BLOCK_N)
    num_row_tiles = tl.load(row_tiles_ptr).to(tl.int32)  # the host launched before it knew them
    num_tiles = num_row_tiles * n_tiles
    if BY_TOKEN:
        rows_ptr += ((epoch % 2) * WORLD * MAX_TOKENS).to(tl.int64) * D  # this epoch's half of the double buffer
        ids_ptr += (epoch % 2) * WORLD * MAX_ROWS
    else:
        rows_ptr += ((epoch % 2) * capacity).to(tl.int64) * D
    lanes = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    t = _next_tile(next_ptr, num_tiles, claimants)
    while t < num_tiles:
        _, expert, begin, rows, row_mask, col = _row_tile(t, tiles_ptr, tiles_width, num_row_tiles, n_tiles,
                                                          BLOCK_M, 3)
        row_mask = row_mask & (rows < capacity)  # rows past the capacity were not pushed (too many this call)
        ns = col * BLOCK_N + tl.arange(0, BLOCK_N)

        # This rank's own rows are read from x (its push copies them into the buffer only for `received`). For
        # the others, wait for what this tile reads: by token, every unit flag of each source it reads; else
        # flag (source of the row, row // CHUNK) of each row, spinning on one missing flag at a time, then looking
        # again at all of them.
        source = tl.load(source_ptr + rows, mask=row_mask, other=0)
        local = row_mask & (source == rank)
        remote = row_mask & (source != rank)
        failed = tl.atomic_add(error_ptr, 0) != 0  # a wait of this launch already timed out: do not spin again
        limit = tl.where(failed, 0, spin_limit)
        timed_out = failed & failed  # False, of the type the waits assign
        if BY_TOKEN:
            for s in tl.static_range(WORLD):
                if (tl.max((remote & (source == s)).to(tl.int32), axis=0) > 0) & ~timed_out:
                    arrived, late = poll_ready(ready_ptr + s * flag_stride, epoch, flag_stride, limit, UNITS_P2)
                    timed_out = ~arrived
                    if timed_out & ~failed:  # the slice: the first unit of this epoch that did not arrive
                        record_timeout(error_ptr, 1, s, late, epoch)
        else:
            flags = ready_ptr + source * flag_stride + rows // CHUNK
            seen = _poll(flags, remote, epoch, BLOCK_M)
            while (tl.min(seen, axis=0) < epoch) & ~timed_out:
                late_row = begin + tl.min(tl.where(seen < epoch, lanes, BLOCK_M), axis=0)
                late_flag = ready_ptr + tl.load(source_ptr + late_row) * flag_stride + late_row // CHUNK
                timed_out = ~wait_at_least(late_flag, epoch, limit)
                seen = _poll(flags, remote, epoch, BLOCK_M)
            if timed_out & ~failed & (tl.min(seen, axis=0) < epoch):  # (all may have come since the wait gave up)
                late_row = begin + tl.min(tl.where(seen < epoch, lanes, BLOCK_M), axis=0)
                record_timeout(error_ptr, 1, tl.load(source_ptr + late_row), late_row // CHUNK, epoch)
        tl.debug_barrier()  # the flags this program's threads acquired cover the rows any of them loads

        source_row = tl.load(source_row_ptr + rows, mask=row_mask, other=0)
        token = tl.load(token_ptr + source_row, mask=local, other=0)
        if BY_TOKEN:  # peers wrote the ids: not from L1
            peer_token = tl.load(ids_ptr + source * MAX_ROWS + source_row, mask=remote, other=0, cache_modifier=".cg")
            peer_row = rows_ptr + (source * MAX_TOKENS + peer_token).to(tl.int64) * D
        else:
            peer_row = rows_ptr + rows.to(tl.int64) * D
        a_rows = tl.where(local, x_ptr + token.to(tl.int64) * D, peer_row)[:, None]
        if BY_TOKEN & STORE_A13:
            if col == 0:  # `received` for the backward's weight gradient: the rows, once. A loop of its own: stored
                # from inside the GEMM's pipelined k loop, the rows corrupted the products on sm_90 (triton 3.6)
                for k in range(0, D, BLOCK_K):
                    a_mask = row_mask[:, None] & (k + ks < D)[None, :]
                    a = tl.load(a_rows + k + ks[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
                    tl.store(rows_out_ptr + rows.to(tl.int64)[:, None] * D + k + ks[None, :], a, mask=a_mask)
        w_cols = expert * D * (2 * FFN) + ns[None, :]  # w1's columns; w3's are FFN further on
        n_mask = ns < FFN
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            k_mask = k + ks < D
            a_mask = row_mask[:, None] & k_mask[None, :]
            a = tl.load(a_rows + k + ks[None, :], mask=a_mask, other=0.0,
                        cache_modifier=".cg")  # peers wrote the received rows: not from L1
            w_mask = k_mask[:, None] & n_mask[None, :]
            w_at = w13_ptr + w_cols + (k + ks)[:, None] * (2 * FFN)
            acc1 = tl.dot(a, tl.load(w_at, mask=w_mask, other=0.0), acc1, input_precision=PRECISION)
            acc3 = tl.dot(a, tl.load(w_at + FFN, mask=w_mask, other=0.0), acc3, input_precision=PRECISION)
        h = acc1 * tl.sigmoid(acc1) * acc3
        out_mask = row_mask[:, None] & n_mask[None, :]
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * FFN + ns[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)
        if STORE_A13:  # training: the backward's SwiGLU gradient reads it instead of recomputing the GEMM
            a13_at = a13_ptr + rows.to(tl.int64)[:, None] * (2 * FFN) + ns[None, :]
            tl.store(a13_at, acc1.to(a13_ptr.dtype.element_ty), mask=out_mask)
            tl.store(a13_at + FFN, acc3.to(a13_ptr.dtype.element_ty), mask=out_mask)
        t = _next_tile(next_ptr, num_tiles, claimants)


@triton.jit(do_not_specialize=["num_row_tiles", "epoch", "tiles_per_rank", "num_tiles", "spin_limit"])
def _gated_gemm_backward_kernel(
    da13_desc, w13_desc,  # TMA descriptors: [rows, 2 * FFN] gradient of x @ w13[e], [L, D, 2 * FFN] weights
    tiles_ptr, num_row_tiles,  # the row tiles (ExpertLayout.gemm_tiles; walked in departure order)
    source_ptr, source_row_ptr, grad_ptrs, ready_ptrs, ack_ptr, error_ptr, next_ptr,
    rank, epoch, tiles_per_rank, num_tiles, spin_limit,
    D: tl.constexpr, FFN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WORLD: tl.constexpr, PRECISION: tl.constexpr,
):
    """dx tile = da13 @ w13[e]^T, each row stored at its source row in its source's gradient buffer; then flag
    (this rank, tile, column block) is raised in every rank (the tile's rows may have several sources)."""
    n_tiles = tl.cdiv(D, BLOCK_N)
    # The guard, once per program: every source has summed the previous epoch's rows (it acknowledged them).
    released = consumer_released(ack_ptr, 0, epoch, spin_limit, error_ptr)
    for s in tl.static_range(1, WORLD):
        released = released & consumer_released(ack_ptr, s, epoch, spin_limit, error_ptr)
    t = _next_tile(next_ptr, num_tiles, tl.num_programs(0))
    while t < num_tiles:
        mt, expert, begin, rows, row_mask, col = _row_tile(t, tiles_ptr, num_row_tiles, num_row_tiles, n_tiles,
                                                           BLOCK_M, 4)
        ns = col * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, 2 * FFN, BLOCK_K):  # da13 was written by this rank's own kernels: TMA reads it
            w = transposed_weight_tile(w13_desc, expert, col * BLOCK_N, k, BLOCK_N, BLOCK_K)
            acc = tl.dot(da13_desc.load([begin.to(tl.int32), k]), w, acc, input_precision=PRECISION)
        source = tl.load(source_ptr + rows, mask=row_mask, other=0)
        out = tl.load(grad_ptrs + source, mask=row_mask, other=0).to(tl.pointer_type(da13_desc.dtype))
        out = tl.multiple_of(out, 16)  # symmetric buffers are aligned: vector stores
        at = tl.load(source_row_ptr + rows, mask=row_mask, other=0)[:, None] * D + ns[None, :]
        tl.store(out[:, None] + at, acc.to(da13_desc.dtype),
                 mask=row_mask[:, None] & (ns < D)[None, :] & released)
        if released:  # no flag over a tile not stored: a source would sum its buffer's older rows as this epoch's
            signal_ready(ready_ptrs, (rank * tiles_per_rank + mt) * n_tiles + col, epoch, WORLD)
        t = _next_tile(next_ptr, num_tiles, tl.num_programs(0))


@triton.jit(do_not_specialize=["epoch"])
def _ack_sources_kernel(ack_ptrs, epoch_ptr, rank, epoch, WORLD: tl.constexpr, EPOCH_ON_DEVICE: tl.constexpr):
    """After the kernel that read a peer-written buffer (stream order): tell every peer this rank is done.
    EPOCH_ON_DEVICE (the forward): the epoch is the one after epoch_ptr's, which this kernel then advances.
    After a wait that gave up too: the reads are over all the same, and a peer that was only late then stores its
    next epoch (without this, every later push into this rank timed out, for good)."""
    if EPOCH_ON_DEVICE:
        epoch = tl.load(epoch_ptr) + 1
    for s in tl.static_range(WORLD):
        ack = tl.load(ack_ptrs + s).to(tl.pointer_type(tl.int32)) + rank
        tl.atomic_xchg(ack, epoch, sem="release", scope="sys")
    if EPOCH_ON_DEVICE:
        tl.store(epoch_ptr, epoch)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(device: torch.device, dtype: torch.dtype, backward: bool = False) -> GemmConfig:
    """The gated GEMM's (and with backward=True its backward GEMM's) configuration. H200 bf16/fp16: 128 x 128
    tiles (the forward has two fp32 accumulators: gate and up); K loops from a sweep on one H200 (8192 tokens,
    d=2048, ffn=1408, 32 local experts, top-6; 2026-11-23, docs/benchmarks.md): the forward in k steps of 32 over
    6 stages (1,122 us against 1,255 at 64 over 3); the backward (TMA tiles) 128 x 256 in steps of 64 over 4
    (2026-11-24: 946-958 us against 1,074-1,084 at 128 x 128 over 4 stages, 1,213-1,224 before TMA; later that day,
    on every SM: 861 us at 4 stages, 869 at 3, and at d=4096, ffn=14336 5,249 against 5,352); fp32
    (IEEE, slow, for checks) k steps of 32 and 2 stages to fit in shared memory; the interpreter: tl.dot's
    minimum. The backward's flags and tables number its tiles: everything about them asks with backward=True."""
    if device.type != "cuda":
        return GemmConfig(16, 16, 16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return GemmConfig(128, 128, 32, num_warps=8, num_stages=2)
    if backward:
        return GemmConfig(128, 256, 64, num_warps=8, num_stages=4)
    return GemmConfig(128, 128, 32, num_warps=8, num_stages=6)


def _check_tile_rows(owner_tile_rows: int, block_m: int) -> None:
    """The GEMMs walk the layout's row tiles, which also number the backward's flags: same rows per tile."""
    if owner_tile_rows != block_m:
        raise ValueError(f"the layout cuts the owner's row tiles of {owner_tile_rows} rows; the GEMM's tiles "
                         f"have {block_m} (build_expert_layout's owner_tile_rows)")


def _check_w13(w13: torch.Tensor, L: int, d: int, ffn: int, dtype: torch.dtype) -> None:
    """The kernels read w13 in place (no per-call copy): it must be a contiguous [L, d, 2 * ffn] of the rows' dtype."""
    if w13.shape != (L, d, 2 * ffn) or w13.dtype != dtype or not w13.is_contiguous():
        raise ValueError(f"w13 must be a contiguous [{L}, {d}, {2 * ffn}] of the rows' dtype {dtype}, got "
                         f"{tuple(w13.shape)} {w13.dtype}{'' if w13.is_contiguous() else ', not contiguous'}")
    require_tma_readable(w13, "w13")  # its backward reads it through TMA


class FusedDispatch:
    """Dispatch + first expert GEMM of one MoE layer on one rank (see the module docstring).

    `reserve` (receive rows, from a layout's max_recv_rows), then `start` and `finish` with DispatchTables made at
    that capacity (and for the gradient `start_backward` then `finish_backward`, with the ExpertLayout), in the
    same order on every rank (flags carry this object's epochs); in a simulated world every rank calls `start`
    before any rank calls `finish`. Where ranks are processes (or a world of one), `begin`, `launch`, `end` do the
    same in one go, and `launch` is kernels only (a CUDA graph can capture it). `errors.check()` after `finish`
    raises PeerWaitTimeout naming rank, peer and chunk when a wait timed out (at once on the CPU). One object per
    MoE layer: the view `finish` returns lives in its buffers. `num_programs`: persistent programs of the push
    kernel (on GPUs it runs on a side stream, concurrently with the GEMM of this epoch); `block_m`: receive rows per
    ready flag (a power of two).

    `max_tokens` (dispatch by token): each token goes to each peer once, whatever number of that peer's experts
    it chose (top_k experts over few ranks: several), into a [source, token] buffer of max_tokens per source,
    with the token of each of the source's permuted rows that the peer owns; GEMM 1 reads a peer's row through
    those ids, and waits for everything its source sent (a count of units per source; the tokens are
    world x fewer bytes than the rows at top_k >= world). By row (None) each routed row is sent. By token,
    `block_m` is the tokens per unit, and the training forward's `received` is stored by GEMM 1 (`rows_out`).
    """

    def __init__(self, workspace: _Workspace, d_model: int, ffn: int, num_local_experts: int, num_programs: int,
                 spin_limit: int, block_m: int = 64, max_tokens: int | None = None, top_k: int = 1,
                 describe_refused: Callable[[int, list[int]], str] | None = None):
        if block_m & (block_m - 1):
            raise ValueError(f"block_m={block_m} must be a power of two")
        if max_tokens is not None and (max_tokens < 1 or top_k < 1):
            raise ValueError(f"max_tokens={max_tokens} and top_k={top_k} must be positive")
        self.max_tokens = max_tokens  # dispatch by token when set
        if max_tokens is not None:
            self.max_rows = max_tokens * top_k  # a source's permuted rows at most (its token ids per peer)
            self.units = triton.cdiv(max_tokens, block_m)  # per peer: tokens in units of block_m, ids alike
            self.ids_per_unit = triton.next_power_of_2(triton.cdiv(self.max_rows, self.units))
            self.top_k = top_k
        self.ws, self.rank, self.world = workspace, workspace.rank, workspace.world_size
        self.d_model, self.ffn, self.num_local_experts = d_model, ffn, num_local_experts
        self.num_programs, self.spin_limit, self.chunk = num_programs, spin_limit, block_m
        self.errors = PeerErrors(workspace.device, self.rank, "fused MoE dispatch", describe_refused=describe_refused)
        self.capacity = 0  # receive rows per half of the double buffer; grows, the same on every rank
        self._dest_order = torch.tensor(remote_first_order(self.rank, self.world), dtype=torch.int32,
                                        device=workspace.device)
        cuda = workspace.device.type == "cuda"
        self._push_stream = torch.cuda.Stream(workspace.device) if cuda else None
        # The push and GEMM 1 are on the host's path to the first expert GEMM: launched through their compiled
        # binaries (fused_dlrm.kernels.launch), keyed on what they are specialised on besides this object's ints.
        self._push_launches = CompiledLaunches(_push_rows_kernel)
        self._push_token_launches = CompiledLaunches(_push_tokens_kernel)
        self._gemm_launches = CompiledLaunches(_gated_gemm_kernel)
        self._sms = torch.cuda.get_device_properties(workspace.device).multi_processor_count if cuda else 0
        self._started: dict[int, tuple] = {}  # epoch -> the tensors its GEMM reads (between `start` and `finish`)
        # The forward epoch whose push was launched and which `end` has not counted yet: while it is set, `begin`
        # refuses (an epoch pushed whose GEMM 1 never ran leaves this rank's epochs behind its peers').
        self._in_flight: int | None = None
        # The GEMMs' programs take tiles in walk order from this counter, so a program that starts late (its SM
        # still busy with the push) takes fewer tiles instead of delaying the end. Each GEMM leaves it at 0
        # (`_next_tile`); the GEMMs run one after the other on one stream (GEMM 1's helpers on the push's stream,
        # which the current stream waits for before the next).
        self._tile_counter = torch.zeros(1, dtype=torch.int32, device=workspace.device)
        # The forward's last epoch acknowledged, on the device: the push and GEMM 1 take the next one, and the
        # acknowledgement after GEMM 1 advances it (in step with the host's count, `end`). So their launches
        # repeat exactly from epoch to epoch, and a CUDA graph of them replays (moe.layer._dispatch_at_capacity).
        self._epoch_done = torch.zeros(1, dtype=torch.int32, device=workspace.device)
        # The address of the epoch's x, stored by `begin`: the kernels read x through it (`_x_rows`), so a graph of
        # the launches needs no copy of x (tens of MB).
        self._x_address = torch.zeros(1, dtype=torch.int64, device=workspace.device)
        self._rows_dtype = torch.float32  # of the receive rows, set by `begin`
        self._grad_dtype = torch.float32  # of the gradient rows, set by start_backward

    def reserve(self, max_recv_rows: int, total_rows: int = 0) -> None:
        """Receive buffers for `max_recv_rows` rows per owner (ExpertLayout.max_recv_rows, the same on every rank),
        with room to spare up to `total_rows` (ExpertLayout.total_rows) when they grow (`receive_capacity`): a
        collective on GPUs when the capacity grows; it never shrinks."""
        self.capacity = receive_capacity(max_recv_rows, self.capacity, total_rows, self.chunk)

    @property
    def by_token(self) -> bool:
        return self.max_tokens is not None

    def _buffers(self, dtype: torch.dtype):
        """By row: (receive rows, ready flags, acks) of the current capacity. By token: (tokens [2, world,
        max_tokens, d], the sources' rows' token ids [2, world, max_rows] int32 and routing weights (fp32, alike),
        flags per (source, unit), acks)."""
        if not self.capacity:
            raise ValueError("no receive capacity yet: reserve first")
        if self.by_token:
            slots = 2 * self.world
            return (self.ws.buffer("moe_dispatch_tokens", slots * self.max_tokens * self.d_model, dtype),
                    self.ws.buffer("moe_dispatch_token_ids", slots * self.max_rows, torch.int32),
                    self.ws.buffer("moe_dispatch_row_weights", slots * self.max_rows, torch.float32),
                    self.ws.buffer("moe_dispatch_units_ready", self.world * self.units, torch.int32),
                    self.ws.buffer("moe_dispatch_ack", self.world, torch.int32))
        rows = self.ws.buffer("moe_dispatch_rows", 2 * self.capacity * self.d_model, dtype)
        # A new capacity gets fresh flags (zero < any epoch): flag buffers cannot grow.
        ready = self.ws.buffer(f"moe_dispatch_ready_{self.capacity}", self.world * self.capacity // self.chunk,
                               torch.int32)
        ack = self.ws.buffer("moe_dispatch_ack", self.world, torch.int32)
        return rows, ready, ack

    def begin(self, x: torch.Tensor) -> int:
        """The host's part before an epoch's launches (`launch`) of rows x: refuses a bad x, raises a timeout seen
        so far, makes the buffers of the current capacity for x's dtype (a collective when they grow), stores x's
        address on the device, where the kernels read it (in stream order: until they ran, x must be neither freed
        nor rewritten, as for any kernel's input) -> the epoch the launches take. The host counts it in `end`, the
        device in the acknowledgement after GEMM 1 (`_epoch_done`): a call refused before its push (`launch`
        checks everything first) counts on neither, and the next call takes the same epoch. While an epoch whose
        push was launched has not ended (its GEMM 1 refused or failed), every call is refused: its peers hold
        that epoch's rows, and this rank's next epochs would no longer be theirs."""
        if x.dim() != 2 or x.shape[1] != self.d_model or x.dtype not in TL_DTYPES:
            raise ValueError(f"x must be [tokens, {self.d_model}] fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
        if not x.is_contiguous() or x.data_ptr() % 16 or x.device != self._x_address.device:
            raise ValueError(f"x must be contiguous, 16-byte aligned and on {self._x_address.device}: the kernels "
                             f"read it through its address (MoELayer passes a copy where it is not)")
        if self.by_token and x.shape[0] > self.max_tokens:
            raise ValueError(f"rank {self.rank}: {x.shape[0]} tokens, more than the dispatch's max_tokens="
                             f"{self.max_tokens}")
        self.errors.check()
        if self._in_flight is not None:
            raise RuntimeError(f"fused MoE dispatch, rank {self.rank}: step {self._in_flight}'s push was launched and "
                               f"the step never ended (its GEMM 1 was refused or failed): the peers hold its rows, "
                               f"and any later step here would wait for flags of another epoch than theirs. Finish "
                               f"it (`finish`, after `start`), or make a new dispatch (a new layer)")
        # refused past MAX_EPOCH here, before the launches: the device's int32 epoch would wrap to -2**31, which
        # every flag satisfies (`end`, which counts the epoch, comes after them)
        epoch = self.ws.upcoming_epoch("moe_dispatch")
        self._buffers(x.dtype)
        self._rows_dtype = x.dtype
        self._x_address.fill_(x.data_ptr())
        return epoch

    def buffer_addresses(self, dtype: torch.dtype) -> tuple[int, ...]:
        """The symmetric buffers' addresses that `launch` bakes into its kernels' arguments for rows of `dtype`."""
        return tuple(b.local.data_ptr() for b in self._buffers(dtype))

    def launch(self, x: torch.Tensor, token_of_row: torch.Tensor, tables: DispatchTables, w13: torch.Tensor,
               a13_out: torch.Tensor | None = None, own_rows: bool = True, inverse: torch.Tensor | None = None,
               rows_out: torch.Tensor | None = None, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The kernels of one epoch between `begin` and `end`: the push of this rank's permuted rows (row i is
        x[token_of_row[i]]) into the owners' receive buffers at tables.send_dest_row, raising the per-chunk flags
        (rows landing past the capacity are not pushed), then GEMM 1, then the acknowledgement -> h (see
        `finish`). The kernels read the epoch and the receive buffer's half from the device, so that a CUDA graph
        can capture these launches and replay them at any later epoch. own_rows=False leaves out the rows this
        rank keeps: GEMM 1 reads those from x, and only `received` (the training backward's weight gradient)
        would show them (at world 1 nothing is copied). By token: `inverse` (Permutation.inverse) says which
        tokens go to which peer, `row_weights` (fp32, one per permuted row: its routing weight) go with the token
        ids (`rows_by_source`), and `rows_out` [capacity, d_model] receives `received` (with a13_out)."""
        self._check_tables(tables)  # everything before the push: a push counts in the peers
        self._check_by_token_inputs(x, token_of_row, inverse, row_weights)
        self._check_gemm_outputs(x, tables, w13, a13_out, rows_out)
        return self._gemm(*self._push(x, token_of_row, tables, own_rows, inverse, row_weights), w13, a13_out,
                          rows_out)

    def end(self, epoch: int) -> torch.Tensor | None:
        """The host's part after an epoch's launches -> received [capacity, d_model]: a view of the symmetric
        receive buffer, valid until the next epoch's `end`, holding this rank's own rows only if the push copied
        them (by token: None; the rows are `launch`'s rows_out). Counts the epoch on the host (before a timeout or
        a refusal of this epoch raises: the device's acknowledgement has counted it too)."""
        if epoch != self.ws.epoch("moe_dispatch") + 1:
            raise RuntimeError(f"fused MoE dispatch, rank {self.rank}: end({epoch}), but the step begun is "
                               f"{self.ws.epoch('moe_dispatch') + 1}")
        self.ws.next_epoch("moe_dispatch")
        self._in_flight = None
        self.errors.after_wait()
        if self.by_token:
            return None
        rows = self._buffers(self._rows_dtype)[0]
        base = (epoch % 2) * self.capacity * self.d_model
        return rows.local[base:base + self.capacity * self.d_model].view(self.capacity, self.d_model)

    def record_refused(self, words: torch.Tensor, epoch: int) -> None:
        """Between an epoch's `launch` and `end`: every rank's refusal words (peer_flags.record_refused), which the
        forward's host does not read, into the error word; every rank, given the same words, raises the same error
        (PeerRefusedInput, `describe_refused`'s message) as it raises a timeout: at a later call, or
        errors.check(block=True) (which clears the word: a backward that reads the words raises it there)."""
        record_refused(words, self.errors.word, self.rank, epoch)

    def rows_by_source(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """By token, after `end` of `epoch`: (token ids [world, max_rows] int32, routing weights [world, max_rows]
        fp32) of every peer's permuted rows that this rank owns, at [source, source row] (this rank's own slot is
        not written). Views of the buffers' half of that epoch: valid until the epoch after next starts here."""
        if not self.by_token:
            raise RuntimeError("rows_by_source: only the dispatch by token sends its rows' tokens and weights")
        _, ids, weights, _, _ = self._buffers(self._rows_dtype)
        half = slice((epoch % 2) * self.world * self.max_rows, (epoch % 2 + 1) * self.world * self.max_rows)
        return ids.local[half].view(self.world, self.max_rows), weights.local[half].view(self.world, self.max_rows)

    def start(self, x: torch.Tensor, token_of_row: torch.Tensor, tables: DispatchTables, own_rows: bool = True,
              inverse: torch.Tensor | None = None, row_weights: torch.Tensor | None = None) -> int:
        """`begin`, then the push of `launch` -> the epoch (`finish` runs the rest: in a simulated world every rank
        pushes before any rank computes)."""
        self._check_tables(tables)  # everything before the push (`launch`)
        self._check_by_token_inputs(x, token_of_row, inverse, row_weights)
        epoch = self.begin(x)
        self._started[epoch] = self._push(x, token_of_row, tables, own_rows, inverse, row_weights)
        return epoch

    def finish(self, epoch: int, w13: torch.Tensor, a13_out: torch.Tensor | None = None,
               rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The grouped GEMM over the received rows, each tile waiting for the chunks it reads, then `end`.

        Returns (received [capacity, d_model] (`end`); h = silu(received @ w1[e]) * (received @ w3[e]) [capacity,
        ffn], a new tensor), w13 = [w1 | w3] read in place. Only the first ExpertLayout.tokens_per_local_expert
        rows are the received ones (the host learns their number after the launch). `a13_out` ([capacity, 2 ffn],
        w13's dtype), if given, receives the products before the activation (training keeps them for
        `start_backward`). By token, received is rows_out (None without it)."""
        started = self._started.get(epoch)
        if started is None:
            raise RuntimeError(f"fused MoE dispatch, rank {self.rank}: finish({epoch}), but no step {epoch} was "
                               f"started here")
        self._check_gemm_outputs(started[0], started[2], w13, a13_out, rows_out)  # refused: may be finished again
        del self._started[epoch]
        h = self._gemm(*started, w13, a13_out, rows_out)
        received = self.end(epoch)
        return rows_out if self.by_token else received, h

    def _check_gemm_outputs(self, x: torch.Tensor, tables: DispatchTables, w13: torch.Tensor,
                            a13_out: torch.Tensor | None, rows_out: torch.Tensor | None) -> None:
        """What GEMM 1 is given besides the push's inputs, checked before `_gemm` (by `launch` before its push: a
        GEMM that refused to run after the push would leave the epoch in flight, `begin`)."""
        _check_w13(w13, self.num_local_experts, self.d_model, self.ffn, x.dtype)
        _check_tile_rows(tables.tile_rows[1], gemm_config(self.ws.device, w13.dtype).block_m)
        if a13_out is not None and (a13_out.shape != (self.capacity, 2 * self.ffn) or a13_out.dtype != w13.dtype
                                    or not a13_out.is_contiguous()):
            raise ValueError(f"a13_out must be a contiguous [{self.capacity}, {2 * self.ffn}] {w13.dtype} tensor, "
                             f"got {tuple(a13_out.shape)} {a13_out.dtype}")
        if self.by_token and ((rows_out is None) != (a13_out is None) or (rows_out is not None and (
                rows_out.shape != (self.capacity, self.d_model) or rows_out.dtype != x.dtype
                or not rows_out.is_contiguous()))):
            raise ValueError(f"dispatch by token: rows_out (a contiguous [{self.capacity}, {self.d_model}] {x.dtype} "
                             f"tensor) comes with a13_out, both or neither")

    def _check_by_token_inputs(self, x: torch.Tensor, token_of_row: torch.Tensor, inverse: torch.Tensor | None,
                               row_weights: torch.Tensor | None) -> None:
        if not self.by_token:
            return
        if inverse is None or inverse.numel() != x.shape[0] * self.top_k:
            raise ValueError(f"dispatch by token needs the permutation's inverse [{x.shape[0]} x {self.top_k}]")
        if row_weights is None or row_weights.shape != token_of_row.shape or row_weights.dtype != torch.float32:
            raise ValueError(f"dispatch by token needs row_weights: fp32 [{token_of_row.numel()}], the routing "
                             f"weight of each permuted row")

    def _check_tables(self, tables: DispatchTables) -> None:
        if tables.world != self.world or tables.rank != self.rank or tables.num_local_experts != self.num_local_experts:
            raise ValueError("the tables do not describe this rank of this dispatch")
        if tables.capacity != self.capacity:
            raise ValueError(f"the tables cover {tables.capacity} receive rows, the dispatch's buffers {self.capacity} "
                             f"(reserve, then dispatch_tables with the dispatch's capacity)")

    def _push(self, x: torch.Tensor, token_of_row: torch.Tensor, tables: DispatchTables, own_rows: bool,
              inverse: torch.Tensor | None, row_weights: torch.Tensor | None) -> tuple:
        """Launch the push (its callers checked the inputs) -> what GEMM 1 reads besides the weights (x,
        token_of_row, tables)."""
        token_of_row = token_of_row.contiguous()  # x is (`begin`), and the kernels read it at _x_address
        block_d = max(16, min(triton.next_power_of_2(self.d_model), PUSH_TILE_ELEMENTS // self.chunk))
        e_p2 = triton.next_power_of_2(self.world * self.num_local_experts)
        if self.by_token:
            tokens, ids, weights, ready, ack = self._buffers(x.dtype)
            inverse, row_weights = inverse.contiguous(), row_weights.contiguous()
            if self._push_stream is not None:  # a copy, if one was made, is read on the push stream
                inverse.record_stream(self._push_stream)
                row_weights.record_stream(self._push_stream)
            tensors = (self._x_address, token_of_row, row_weights, inverse, tables.counts, self._dest_order,
                       tokens.peer_ptrs, ids.peer_ptrs, weights.peer_ptrs, ready.peer_ptrs, ack.local,
                       self.errors.word, self._epoch_done)
            args = (*tensors, self.rank, x.shape[0], token_of_row.numel(), self.num_programs, self.spin_limit,
                    self.d_model, self.max_tokens, self.max_rows, self.chunk, self.ids_per_unit, self.units, block_d,
                    self.world, self.num_local_experts, self.top_k, triton.next_power_of_2(self.top_k), e_p2,
                    TL_DTYPES[x.dtype])
            kernel_launches, key = self._push_token_launches, (x.dtype, block_d, *map(aligned, tensors))
        else:
            rows, ready, ack = self._buffers(x.dtype)
            chunks = self.capacity // self.chunk
            tensors = (self._x_address, token_of_row, tables.send_dest_row, tables.counts, self._dest_order,
                       rows.peer_ptrs, ready.peer_ptrs, ack.local, self.errors.word, self._epoch_done)
            args = (*tensors, self.rank, chunks, self.world * chunks, self.num_programs, self.spin_limit,
                    self.d_model, self.chunk, block_d, self.world, self.num_local_experts,
                    triton.next_power_of_2(self.world), triton.next_power_of_2(self.num_local_experts), e_p2, own_rows,
                    TL_DTYPES[x.dtype])
            kernel_launches, key = self._push_launches, (x.dtype, block_d, own_rows, *map(aligned, tensors))

        def launch():
            kernel_launches(key, (self.num_programs, 1, 1), args, {})

        self._in_flight = self.ws.epoch("moe_dispatch") + 1  # until `end`
        if self._push_stream is None:
            launch()
        else:  # the GEMM (next on the current stream) overlaps the push, waiting per tile
            self._push_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._push_stream):
                launch()
        return x, token_of_row, tables

    def _gemm(self, x: torch.Tensor, token_of_row: torch.Tensor, tables: DispatchTables, w13: torch.Tensor,
              a13_out: torch.Tensor | None, rows_out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch GEMM 1 (on GPUs beside the push) and the acknowledgement -> h [capacity, ffn] (the caller has
        checked w13, a13_out, rows_out and the tables' tile rows: `_check_gemm_outputs`)."""
        L, d, ffn = self.num_local_experts, self.d_model, self.ffn
        if self.by_token:
            tokens, ids, _, ready, ack = self._buffers(x.dtype)
            rows, ids, ready = tokens.local, ids.local, ready.local
            flag_stride = self.units
        else:
            rows, ready, ack = self._buffers(x.dtype)
            rows, ready, ids = rows.local, ready.local, ready.local  # ids: unused
            flag_stride = self.capacity // self.chunk
        h = torch.empty(self.capacity, ffn, dtype=w13.dtype, device=w13.device)
        cfg = gemm_config(self.ws.device, w13.dtype)
        tiles = tables.gemm_tiles
        num_tiles = tiles.shape[1] * triton.cdiv(ffn, cfg.block_n)  # at most: the GEMM reads how many are listed
        programs = self._gemm_programs(num_tiles, beside_push=True)
        helpers = self._helper_programs(num_tiles, programs)
        a13 = h if a13_out is None else a13_out
        tensors = (rows, self._x_address, token_of_row, w13, h, a13, a13 if rows_out is None else rows_out, tiles)
        tensors += (tables.row_tiles, tables.recv_source_rank, tables.recv_source_row, ready, ids, self.errors.word,
                    self._tile_counter, self._epoch_done)
        precision, store_a13 = dot_precision(w13.dtype, w13.device), a13_out is not None
        by_token = (self.max_tokens, self.max_rows, triton.next_power_of_2(self.units)) if self.by_token else (1, 1, 1)
        args = (*tensors[:8], tiles.shape[1], *tensors[8:], self.rank, self.capacity, flag_stride,
                programs + helpers, self.spin_limit, d, ffn, self.chunk, cfg.block_m, cfg.block_n, cfg.block_k,
                precision, store_a13, self.by_token, self.world, *by_token)
        key = (x.dtype, w13.dtype, cfg, precision, store_a13, self.by_token, *map(aligned, tensors))
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if helpers:  # they read what this stream made for GEMM 1 since the push was launched (w13, say)
            self._push_stream.wait_stream(torch.cuda.current_stream())
        self._gemm_launches(key, (programs, 1, 1), args, options)
        if helpers:
            with torch.cuda.stream(self._push_stream):
                self._gemm_launches(key, (helpers, 1, 1), args, options)
        if self._push_stream is not None:  # then what the push read may be freed, and `received` and h are complete
            torch.cuda.current_stream().wait_stream(self._push_stream)
        _ack_sources_kernel[(1,)](ack.peer_ptrs, self._epoch_done, self.rank, 0,  # read on the device
                                  WORLD=self.world, EPOCH_ON_DEVICE=True)
        return h

    # -- backward: the rows' gradient goes back to its sources (a combine), summed over each token's k rows ----
    def start_backward(self, dh: torch.Tensor, received: torch.Tensor, layout: ExpertLayout, w13: torch.Tensor,
                       a13: torch.Tensor | None = None, weight_grad_dtype: torch.dtype | None = None
                       ) -> tuple[int, torch.Tensor]:
        """Owner side: dh = dL/dh [recv_rows, ffn] and the forward's `received` rows (and its a13, which spares
        recomputing GEMM 1) -> (epoch, dw13), dw13 in weight_grad_dtype (None: the rows'; mixed precision asks
        for its fp32 parameters' dtype).
        The kernel stores the rows' gradient da13 @ w13[e]^T straight into each source's
        gradient buffer at the row's permuted position, tiles for remote sources first. Every rank calls
        `start_backward` before any rank calls `finish_backward`."""
        self.errors.check()
        _check_w13(w13, self.num_local_experts, self.d_model, self.ffn, received.dtype)
        da13, dw13 = gated_gemm_grads(received, layout.tokens_per_local_expert, w13, dh, a13, weight_grad_dtype)
        grad, ready, ack, tiles_per_rank = self._grad_buffers(layout, received.dtype)
        cfg = gemm_config(self.ws.device, received.dtype, backward=True)
        _check_tile_rows(layout.owner_tile_rows, cfg.block_m)
        # Taken once nothing can refuse the call: an epoch no kernel ran is never acknowledged, and every later
        # backward's GEMM would wait for its acknowledgement.
        epoch = self.ws.next_epoch("moe_dispatch_grad")
        tiles = layout.gemm_tiles
        num_tiles = tiles.shape[1] * triton.cdiv(self.d_model, cfg.block_n)
        if tiles.shape[1]:  # no row tiles: nothing to compute, store or flag
            _gated_gemm_backward_kernel[(self._gemm_programs(num_tiles, beside_push=False),)](
                descriptor(da13, [cfg.block_m, cfg.block_k], "da13"),
                descriptor(w13, [1, cfg.block_n, cfg.block_k], "w13"), tiles, tiles.shape[1],
                layout.recv_source_rank, layout.recv_source_row, grad.peer_ptrs, ready.peer_ptrs, ack.local,
                self.errors.word, self._tile_counter, self.rank, epoch, tiles_per_rank, num_tiles, self.spin_limit,
                D=self.d_model, FFN=self.ffn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                WORLD=self.world, PRECISION=dot_precision(da13.dtype, da13.device),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return epoch, dw13

    def finish_backward(self, epoch: int, layout: ExpertLayout, perm: Permutation) -> torch.Tensor:
        """Source side: dx [tokens, d_model] (the rows' dtype), per token the sum in fp32 of its kept rows'
        gradients, each block of tokens summed as soon as the owners' flags of its rows are up (FusedCombine's
        consumer kernel with unit weights); then the epoch is acknowledged to every owner."""
        grad, ready, ack, tiles_per_rank = self._grad_buffers(layout, self._grad_dtype)
        cfg = gemm_config(self.ws.device, self._grad_dtype, backward=True)  # the tiles start_backward's flags number
        _check_tile_rows(layout.owner_tile_rows, cfg.block_m)
        num_tokens = perm.inverse.numel() // perm.top_k
        dx = torch.empty(num_tokens, self.d_model, dtype=self._grad_dtype, device=perm.inverse.device)
        if num_tokens:
            block_tokens = 16 if dx.is_cuda else 8
            _weighted_unpermute_kernel[(triton.cdiv(num_tokens, block_tokens), triton.cdiv(self.d_model,
                                                                                            cfg.block_n))](
                grad.local, perm.inverse, torch.ones(num_tokens, perm.top_k, device=dx.device),
                torch.add(layout.send_owner_tile, layout.send_dest_rank, alpha=tiles_per_rank),  # flag slots
                layout.send_dest_rank, layout.send_dest_row, ready.local, self.errors.word, dx, dx, num_tokens,
                layout.send_dest_rank.numel(), 2**31 - 1, epoch, self.spin_limit,  # every row comes back
                D_MODEL=self.d_model, TOP_K=perm.top_k, K_P2=triton.next_power_of_2(perm.top_k),
                BLOCK_T=block_tokens, BLOCK_N=cfg.block_n, OUT_DTYPE=TL_DTYPES[dx.dtype], COPY_ROWS=False,
                num_warps=4 if dx.is_cuda else 1)
        _ack_sources_kernel[(1,)](ack.peer_ptrs, self._epoch_done, self.rank, epoch,
                                  WORLD=self.world, EPOCH_ON_DEVICE=False)
        self.errors.after_wait()
        return dx

    def _grad_buffers(self, layout: ExpertLayout, dtype: torch.dtype):
        """(gradient rows [max_send_rows, d] of each source, flags per (owner, row tile, column block), acks,
        row tiles per owner): one buffer, guarded by the sources' acks (the sum reads it, dx is a new tensor)."""
        self._grad_dtype = dtype
        cfg = gemm_config(self.ws.device, dtype, backward=True)  # the backward GEMM's tiles
        rows = self.ws.buffer("moe_dispatch_grad_rows", triton.next_power_of_2(layout.max_send_rows) * self.d_model,
                              dtype)
        # Row tiles of any owner: at most cdiv(rows, BLOCK_M) + one partial tile per local expert.
        tiles_per_rank = triton.cdiv(self.capacity, cfg.block_m) + self.num_local_experts
        ready = self.ws.buffer(f"moe_dispatch_grad_ready_{tiles_per_rank}",
                               self.world * tiles_per_rank * triton.cdiv(self.d_model, cfg.block_n),
                               torch.int32)
        ack = self.ws.buffer("moe_dispatch_grad_ack", self.world, torch.int32)
        return rows, ready, ack, tiles_per_rank

    def _gemm_programs(self, num_tiles: int, beside_push: bool) -> int:
        """Persistent GEMM programs, one per SM on GPUs. GEMM 1's tiles wait for flags that push kernels raise
        (this GPU's on the side stream, and the peers'): it leaves PUSH_SMS SMs free so that the pushes always
        find room to run. The backward GEMM waits for no push (only for the acks of the previous epoch) and
        takes every SM."""
        if self._push_stream is None:
            return max(1, min(num_tiles, self.num_programs))
        return max(1, min(num_tiles, self._sms - (PUSH_SMS if beside_push else 0)))

    def _helper_programs(self, num_tiles: int, programs: int) -> int:
        """GEMM 1's programs queued behind the push on its stream (GPUs only), up to PUSH_SMS and never more than
        the tiles the other programs leave: once the push is done, its SMs take tiles from the same counter."""
        if self._push_stream is None:
            return 0
        return max(0, min(PUSH_SMS, num_tiles - programs))
