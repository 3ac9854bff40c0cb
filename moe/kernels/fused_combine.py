"""The MoE combine fused with the second expert GEMM: each output tile goes straight to its token's source rank.

Owner side (`start`): a persistent grouped GEMM out = h @ w2[e] over the rows this rank's experts received
(grouped by local expert, then source rank: moe.expert_layout's receive order). A tile is BLOCK_M rows of one
(local expert, source) block by BLOCK_N columns, so all its rows belong to one source; it is stored at
`recv_source_row` of that source's symmetric combine buffer (the source's permuted-row order, zero-copy), then
the tile's ready flag in the source's flag buffer is raised (release, system scope). Tiles for remote sources
come first, rotated by rank (DispatchTables.combine_tiles, made from the counts on the GPU, whose number the kernel
reads from memory: the host launches it without knowing the counts); this rank's own tiles last.

Source side (`finish`): a weighted-unpermute kernel; each program takes a block of tokens x BLOCK_N columns,
waits (bounded) for the flags of exactly the tiles that hold its tokens' k rows, and sums weight * row in
assignment order in fp32 (deterministic); a row past its owner's receive capacity, which no tile holds (a bound
that did not hold), counts as dropped. A small kernel then acknowledges the epoch to every owner.

Flags: source s numbers the owner tiles that hold its rows by (global expert g, row block i of its C[s, g] rows):
slot = sum_{g' < g} cdiv(C[s, g'], BLOCK_M) + i, times the column blocks. Every rank knows C, so both sides agree.
Flags carry the epoch and are compared with `>=`. Guard: an owner stores a tile of epoch E for source s only once
s has acknowledged E - 1, i.e. its consumer finished reading the previous rows and saw all its flags; so one
combine buffer suffices (the consumer reads it, the result is a fresh tensor) and no flag of E can be mistaken
for one of E - 1 by a slot that another owner used.

By token (`start_by_token` / `finish_by_token`; FusedCombine(max_tokens=...), with the dispatch by token, which
brings the owner each peer row's token id and routing weight): with top_k experts over few ranks a token has
several experts on one owner, and by row each of their outputs crosses. By token the owner's GEMM 2 stores its
tiles locally; a kernel over the tile table notes each received row under (source, token, local expert); then
per (token block, source), the sources alternating (remote stores beside local sums), the owner sums weight * row
over the token's rows here in fp32 (sorted: the same order every run) and stores that one part at [owner, token]
of the source's parts buffer, one flag per (owner, token block), behind the same ack guard. In the same kernel the
items of the rank's own tokens, once their own part is stored, add their tokens' parts in rank order, waiting for
the flags of the owners those tokens chose (items are taken by ticket, so these waits cannot deadlock); the last
item done acknowledges the epoch. At top_k >= world about top_k / world fewer rows cross. Each assignment's own
row never reaches the source: the owner keeps its rows (OwnerRows: GEMM 2's output, each row's weight and token)
for the backward by token.

Backward, the same move reversed. Source (`start_backward`): each program takes BLOCK_R of the source's permuted
rows, forms their gradient rows grad_y[token] * weight (no copy) and stores each at `send_dest_row` of its owner's
symmetric gradient buffer (receive order), then raises flag (source, block) in every rank; blocks start at the
rows of rank + 1 (remote first, rotated). Owner (`finish_backward`): grad_h = g @ w2[e]^T, each tile waiting for
the flags of its rows' (source, block); then grad_w2 = h^T g (torch), and the epoch is acknowledged to every
source, which guards the gradient buffer the same way.

Backward by token (after a forward by token): the source (`start_backward_by_token`) stores grad_y[t] once into
each rank that holds an expert of t (itself too: a local copy), at [source, t] of its gradient token buffer, a
flag per (source, token block). The owner's GEMM (`finish_backward_by_token`) reads row R's output gradient
grad_y_s[t] through its token, each tile waiting for its rows' token blocks, and scales its products by w_R; the
tiles of the first
ffn block also store the weighted rows (for grad_w2) and send each row's routing weight gradient <grad_y_s[t],
y_R> to its source as one int64 word (epoch << 32 | fp32 bits) at the source's permuted row: the word is its own
flag. The source reads the words late (`routing_weights_grad_by_token`), waiting (bounded) for this epoch in
each; an owner rewrites a source's words only in the next epoch's GEMM, which waits for that source's next
push, which its stream runs after this read.

After a wait gave up (PeerWaitTimeout): every consumer still acknowledges the epoch (its reads are over), a producer
that gave up waiting for an acknowledgement raises no flag over what it did not store, and an owner stores no word
for a row whose gradient never came: a peer that was only late finishes the epoch exactly or times out naming the
rank (never taking an older epoch's rows, or a word never computed, as this one's), and the next epoch is exact.
(An owner late by the bound could still land its tiles in the single combine buffer while its source reads an
epoch that holds none of its rows, and so waits for none of its flags; MoELayer's calls cannot: each begins with
the counts' all-gather, which waits for every rank.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import PeerBuffer, _Workspace
from fused_dlrm.kernels import TL_DTYPES, dot_precision
from fused_dlrm.kernels.launch import CompiledLaunches, aligned
from fused_dlrm.kernels.peer_flags import (PeerErrors, _spin_limit_unless_failed, consumer_released, record_timeout,
                                           signal_peer, signal_ready, wait_or_record)
from fused_dlrm.kernels.peer_tiles import remote_first_order
from fused_dlrm.kernels.tma import descriptor, require_tma_readable
from moe.expert_layout import DispatchTables, ExpertLayout, receive_capacity
from moe.experts import grouped_weight_grad
from moe.kernels.tile_order import grouped_tile
from moe.kernels.tma_tiles import transposed_weight_tile
from moe.permute import Permutation, unpermute

# Per-call ints of the kernels here and in fused_dispatch are do_not_specialize: Triton specialises an int on == 1 and
# on % 16 == 0, so epoch 16 (or a new row count) would compile other variants in the middle of training (the 16th
# forward of a layer took 840 ms on 2 x H200, 2026-11-23).


@dataclass
class CombinePlan:
    """One epoch's tables and buffers, from `start` to `finish`."""

    tables: DispatchTables  # combine_tiles: the owner GEMM's row tiles; send_tile: the flag slot of each row's tile
    dtype: torch.dtype
    rows: PeerBuffer  # the combine buffer: this rank's permuted rows, written by their owners
    ready: PeerBuffer  # int32 flags, per (flag slot, column block)
    ack: PeerBuffer  # int32 [world]: the epoch each source has finished reading


@dataclass
class OwnerRows:
    """What the owner's forward by token keeps for the backward by token, per received row (receive order,
    the tables' capacity of rows, the received ones first)."""

    y: torch.Tensor  # GEMM 2's output [rows, d_model]: the routing weights' gradient reads it
    weight: torch.Tensor  # the row's routing weight (fp32)
    token: torch.Tensor  # the row's token on its source (int32): its gradient is grad_y[token] there


@dataclass
class TokenSum:
    """One epoch of the combine by token, from `start_by_token` to `finish_by_token`."""

    tables: DispatchTables
    perm: Permutation  # the source's: its tokens' rows and their owners
    owner: OwnerRows
    out: torch.Tensor  # the source's result [tokens, d_model]


@dataclass
class TokenGradients:
    """One epoch of the backward by token, from `start_backward_by_token` to `routing_weights_grad_by_token`."""

    layout: ExpertLayout
    perm: Permutation
    grad_y: torch.Tensor  # this rank's, read in place by its own GEMM
    epoch: int


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
    block_rows: int  # backward push: permuted rows per program (and per ready flag)
    block_d: int  # backward push: columns per step
    part_cols: int  # the combine by token's sum: columns per step
    part_tokens: int  # the combine by token's sum: tokens per item (and per flag)


def _gemm_steps(blocks: CombineBlocks, dtype: torch.dtype, cuda: bool) -> tuple[int, int]:
    """(k step, pipeline stages) of a GEMM launch: fp32 tiles on GPUs take half the k step and two stages, to
    fit in shared memory."""
    return (32, 2) if cuda and dtype == torch.float32 else (blocks.block_k, blocks.gemm_stages)


def combine_blocks(device: torch.device) -> CombineBlocks:
    if device.type == "cuda":  # bf16 tensor-core tiles for H100/H200: 128 x 256 was the sweep's best GEMM 2 at
        # d=2048, ffn=1408 and at d=4096, ffn=14336 (docs/benchmarks.md, sixth session)
        # The sum by token: 8 tokens per item (2xH100, 2026-11-27: 154 us per forward at the first config against
        # 189 at 16; docs/benchmarks.md).
        return CombineBlocks(128, 256, 64, 8, 3, 16, 4, 32, 128, 256, 8)
    return CombineBlocks(16, 16, 16, 1, 1, 8, 1, 8, 16, 16, 8)  # the interpreter: small tiles, small test shapes


def fused_combine_reference(hs: list[torch.Tensor], w2s: list[torch.Tensor], layouts: list[ExpertLayout],
                            perms: list[Permutation], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole world in float64: owner d's expert outputs h_d @ w2_d[e] go back to their sources' permuted rows,
    which each source unpermutes with its routing weights. Returns every rank's [tokens, d_model]."""
    return [unpermute(rows, perm, w.double())
            for rows, perm, w in zip(_expert_rows_reference(hs, w2s, layouts), perms, weights)]


def routing_weights_grad_reference(grad_ys: list[torch.Tensor], hs: list[torch.Tensor], w2s: list[torch.Tensor],
                                   layouts: list[ExpertLayout], perms: list[Permutation]) -> list[torch.Tensor]:
    """Float64: each rank's [tokens, top_k] gradient of its routing weights, <grad_y[t], expert output of (t, j)>
    (0 for a dropped assignment)."""
    out = []
    for rows, grad_y, perm in zip(_expert_rows_reference(hs, w2s, layouts), grad_ys, perms):
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # a dropped assignment's row: one past the last
        per_assignment = rows[perm.inverse].view(-1, perm.top_k, rows.shape[1])
        out.append(torch.einsum("tkd,td->tk", per_assignment, grad_y.double()))
    return out


def _expert_rows_reference(hs: list[torch.Tensor], w2s: list[torch.Tensor],
                           layouts: list[ExpertLayout]) -> list[torch.Tensor]:
    """Float64: each source's permuted rows' expert outputs h_d @ w2_d[e], from their owners d."""
    d_model = w2s[0].shape[-1]
    combined = [torch.full((lay.send_dest_row.numel(), d_model), float("nan"), dtype=torch.float64)
                for lay in layouts]
    for h, w2, lay in zip(hs, w2s, layouts):
        out = torch.cat([rows.double() @ w2[e].double()
                         for e, rows in enumerate(torch.split(h, lay.tokens_per_local_expert))])
        for s in range(lay.world):
            mine = lay.recv_source_rank.cpu() == s
            combined[s][lay.recv_source_row.cpu()[mine]] = out[mine]
    return combined


def fused_combine_backward_reference(grad_ys: list[torch.Tensor], perms: list[Permutation],
                                     weights: list[torch.Tensor], hs: list[torch.Tensor], w2s: list[torch.Tensor],
                                     layouts: list[ExpertLayout]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Float64: per owner, its received rows' gradients g (grad_y[token] * weight of the source's row, in receive
    order), then (g @ w2[e]^T, h_e^T @ g_e) per local expert."""
    grads = [(gy.double()[p.order // p.top_k] * w.double().reshape(-1)[p.order, None])
             for gy, p, w in zip(grad_ys, perms, weights)]
    out = []
    for h, w2, lay in zip(hs, w2s, layouts):
        sources, source_rows = lay.recv_source_rank.tolist(), lay.recv_source_row.tolist()
        g = torch.stack([grads[s][r] for s, r in zip(sources, source_rows)]) if sources else \
            torch.zeros(0, w2.shape[-1], dtype=torch.float64)
        parts = list(zip(torch.split(g, lay.tokens_per_local_expert),
                         torch.split(h.double(), lay.tokens_per_local_expert)))
        grad_h = torch.cat([ge @ w2[e].double().t() for e, (ge, _) in enumerate(parts)])
        out.append((grad_h, torch.stack([he.t() @ ge for ge, he in parts])))
    return out


@triton.jit(do_not_specialize=["width", "num_programs", "epoch", "spin_limit"])  # one variant for all steps
def _expert_down_kernel(h_ptr, w2_ptr, tiles_ptr, tile_count_ptr, out_ptrs, ready_ptrs, ack_ptr, error_ptr, y_ptr,
                        width, num_programs, epoch, spin_limit,
                        FFN: tl.constexpr, D_MODEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        STORE_LOCAL: tl.constexpr):
    """Persistent: steps pid, pid + P, ... of the (row tile, column block) walk in grouped order (tile_order); the
    tile table ([6, width], its first *tile_count_ptr columns listed) is remote-first. STORE_LOCAL (the combine by
    token): tiles go to y [rows, D_MODEL] in receive order on this rank, without flags (the owner sums each
    token's rows before anything crosses)."""
    N_COL: tl.constexpr = (D_MODEL + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    num_row_tiles = tl.load(tile_count_ptr).to(tl.int32)
    t = pid
    while t < num_row_tiles * N_COL:
        tile, col = grouped_tile(t, num_row_tiles, N_COL)
        # tile table rows: first h row, row count, local expert, source rank, first source row, flag slot
        h_row = tl.load(tiles_ptr + tile)
        count = tl.load(tiles_ptr + width + tile)
        expert = tl.load(tiles_ptr + 2 * width + tile)
        dest = tl.load(tiles_ptr + 3 * width + tile)
        dest_row = tl.load(tiles_ptr + 4 * width + tile)
        slot = tl.load(tiles_ptr + 5 * width + tile)
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
        if STORE_LOCAL:
            tl.store(y_ptr + (h_row + m)[:, None] * D_MODEL + cols[None, :], acc.to(OUT_DTYPE),
                     mask=row_mask[:, None] & col_mask[None, :])
        else:
            # The guard, as late as possible: the source has finished reading the previous epoch's rows.
            released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
            out = tl.multiple_of(tl.load(out_ptrs + dest).to(tl.pointer_type(OUT_DTYPE)), 16)  # vector stores
            out_ptr = out + (dest_row + m)[:, None] * D_MODEL + cols[None, :]
            tl.store(out_ptr, acc.to(OUT_DTYPE), mask=row_mask[:, None] & col_mask[None, :] & released)
            if released:
                signal_peer(ready_ptrs, dest, slot * N_COL + col, epoch)
        t += num_programs


# -- the combine by token: one row per (token, owner) crosses, the owner's weighted sum of that token's rows ----
@triton.jit(do_not_specialize=["width"])  # one variant for all steps
def _rows_of_tokens_kernel(tiles_ptr, tile_count_ptr, width, row_tokens_ptr, row_weights_ptr, own_token_ptr,
                           own_weight_ptr, rows_of_token_ptr, weight_of_row_ptr, token_of_row_ptr, rank,
                           BLOCK_M: tl.constexpr, MAX_TOKENS: tl.constexpr, MAX_ROWS: tl.constexpr,
                           L: tl.constexpr):
    """Program p: row tile p of the combine's table. Each of its receive rows R (local expert e, source s, source
    row i) is token t of s with weight w: rows_of_token[s, t, e] = R, weight_of_row[R] = w, token_of_row[R] = t
    (the backward by token reads the row's gradient as [s, t]). A peer's t and w are what its dispatch push sent
    ([source, source row]); this rank's own come from its permutation."""
    tile = tl.program_id(0)
    if tile < tl.load(tile_count_ptr):
        m = tl.arange(0, BLOCK_M)
        h_row = tl.load(tiles_ptr + tile)
        row_mask = m < tl.load(tiles_ptr + width + tile)
        expert = tl.load(tiles_ptr + 2 * width + tile)
        source = tl.load(tiles_ptr + 3 * width + tile)
        source_row = tl.load(tiles_ptr + 4 * width + tile) + m
        if source == rank:
            token = tl.load(own_token_ptr + source_row, mask=row_mask, other=0).to(tl.int64)
            weight = tl.load(own_weight_ptr + source_row, mask=row_mask, other=0.0)
        else:  # peers wrote these: not from L1
            token = tl.load(row_tokens_ptr + source * MAX_ROWS + source_row, mask=row_mask, other=0,
                            cache_modifier=".cg").to(tl.int64)
            weight = tl.load(row_weights_ptr + source * MAX_ROWS + source_row, mask=row_mask, other=0.0,
                             cache_modifier=".cg")
        rows = h_row + m
        tl.store(rows_of_token_ptr + (source * MAX_TOKENS + token) * L + expert, rows, mask=row_mask)
        tl.store(weight_of_row_ptr + rows, weight, mask=row_mask)
        tl.store(token_of_row_ptr + rows, token.to(tl.int32), mask=row_mask)


@triton.jit(do_not_specialize=["token_blocks", "num_tokens", "num_rows", "epoch", "spin_limit"])  # one variant
def _sum_token_rows_kernel(y_ptr, rows_of_token_ptr, weight_of_row_ptr, source_order_ptr, parts_ptrs, ready_ptrs,
                           ack_ptrs, inverse_ptr, owner_of_row_ptr, out_ptr, counters_ptr, error_ptr, rank,
                           token_blocks, num_tokens, num_rows, epoch, spin_limit,
                           D_MODEL: tl.constexpr, MAX_TOKENS: tl.constexpr, WORLD: tl.constexpr, L: tl.constexpr,
                           L_P2: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
                           FIRST: tl.constexpr, SOURCES: tl.constexpr, ACK: tl.constexpr):
    """Item (token block, source s) of the combine by token; a launch runs the SOURCES sources from
    source_order[FIRST] on (remote first, this rank last) of every token block, sources alternating from item to
    item, so that stores to peers (bound by the link) run beside the local sums (bound by memory).

    Owner side, every item: per token of s that has rows here (at most ROWS = min(top_k, L)), the sum of weight *
    row (in descending receive row: the same sum on every run), stored at [this rank, token] of s's parts buffer.
    For a peer s, flag (this rank, token block) in s follows (one per item: its release waits for the stores to
    reach the peer, which items of all columns would each have waited for).
    Source side, the items of this rank's own tokens (s = rank), after their own part: for each owner (rank order:
    the same sum on every run) that holds an expert of one of the block's tokens, wait (bounded) for that owner's
    flag of the block, then add its parts; out = the sum.

    Items are taken by ticket (one atomic per program), so every item before a program's is held by a program
    that runs: a source item of block b waits only for peers' items of blocks up to b, which come before it in
    every rank's ticket order, so no set of waiting programs can keep the items they wait for from running (and
    the own part is computed before the wait: a late poll of a flag that has mostly come). The last ticket resets
    the counter for the next launch. ACK (a launch with the own items): the last item to finish acknowledges the
    epoch to every owner (this rank has read all its parts), instead of a kernel after this one.
    counters: [next ticket, items done], each left at 0."""
    items = SOURCES * token_blocks
    item = tl.atomic_add(counters_ptr, 1)
    if item == items - 1:
        tl.atomic_xchg(counters_ptr, 0)
    source = tl.load(source_order_ptr + FIRST + item % SOURCES)
    block = item // SOURCES
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < MAX_TOKENS
    es = tl.arange(0, L_P2)
    rows = tl.load(rows_of_token_ptr + (source * MAX_TOKENS + tokens)[:, None] * L + es[None, :],
                   mask=token_mask[:, None] & (es < L)[None, :], other=-1)
    # A token's few rows here first: ROWS steps instead of one per local expert (most of them -1).
    rows = tl.sort(rows, dim=1, descending=True)
    here = tl.max(rows, axis=1) >= 0
    # The guard: s has finished reading the previous epoch's parts.
    released = consumer_released(tl.load(ack_ptrs + rank).to(tl.pointer_type(tl.int32)), source, epoch, spin_limit,
                                 error_ptr)
    parts_of_source = tl.multiple_of(tl.load(parts_ptrs + source).to(tl.pointer_type(OUT_DTYPE)), 16)  # vectors
    parts = parts_of_source + (rank * MAX_TOKENS + tokens).to(tl.int64)[:, None] * D_MODEL
    for first_col in tl.static_range(0, D_MODEL, BLOCK_N):
        cols = first_col + tl.arange(0, BLOCK_N)
        col_mask = cols < D_MODEL
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(ROWS):
            row = tl.sum(tl.where(es[None, :] == j, rows, 0), axis=1)
            ok = row >= 0
            w = tl.load(weight_of_row_ptr + row, mask=ok, other=0.0)
            y = tl.load(y_ptr + row.to(tl.int64)[:, None] * D_MODEL + cols[None, :],
                        mask=ok[:, None] & col_mask[None, :], other=0.0)
            acc += y.to(tl.float32) * w[:, None]
        tl.store(parts + cols[None, :], acc.to(OUT_DTYPE), mask=(here & released)[:, None] & col_mask[None, :])
    tl.debug_barrier()  # every thread's stores before the own part is read back (signal_peer has its own)
    if source != rank:
        if released:
            signal_peer(ready_ptrs, source, rank * token_blocks + block, epoch)
    else:
        own_ready = tl.load(ready_ptrs + rank).to(tl.pointer_type(tl.int32))
        _sum_owner_parts(parts_of_source, tokens, inverse_ptr, owner_of_row_ptr, own_ready, error_ptr, out_ptr, rank,
                         num_tokens, num_rows, token_blocks, block, epoch, spin_limit, D_MODEL, MAX_TOKENS, TOP_K,
                         K_P2, WORLD, BLOCK_T, BLOCK_N, OUT_DTYPE)
    if ACK:
        tl.debug_barrier()  # this item's loads and stores before it counts as done
        if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == items - 1:  # every item's reads are done
            tl.atomic_xchg(counters_ptr + 1, 0)
            signal_ready(ack_ptrs, rank, epoch, WORLD)


@triton.jit
def _owners_of_assignments(tokens, num_tokens, inverse_ptr, owner_of_row_ptr, num_rows, TOP_K: tl.constexpr,
                           K_P2: tl.constexpr):
    """[tokens, K_P2]: the owner rank of each of the tokens' assignments; -1 where dropped (the inverse points one
    past the last row), past top_k or past the tokens."""
    js = tl.arange(0, K_P2)
    row = tl.load(inverse_ptr + tokens[:, None] * TOP_K + js[None, :],
                  mask=(tokens < num_tokens)[:, None] & (js[None, :] < TOP_K), other=num_rows)
    return tl.load(owner_of_row_ptr + row, mask=row < num_rows, other=-1)


@triton.jit
def _sum_owner_parts(parts_ptr, tokens, inverse_ptr, owner_of_row_ptr, ready_ptr, error_ptr, out_ptr, rank,
                     num_tokens, num_rows, token_blocks, block, epoch, spin_limit, D_MODEL: tl.constexpr,
                     MAX_TOKENS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The source's sum of a block of its tokens: out[t] = the parts [owner, t] (this rank's parts buffer, in
    rank order) of the owners that hold an expert of t, each peer's once its flag of the block is up."""
    token_mask = tokens < num_tokens
    owner = _owners_of_assignments(tokens, num_tokens, inverse_ptr, owner_of_row_ptr, num_rows, TOP_K, K_P2)
    for o in tl.static_range(WORLD):
        if o != rank:
            if tl.max(tl.max((owner == o).to(tl.int32), axis=1), axis=0) > 0:
                slot = o * token_blocks + block
                wait_or_record(ready_ptr + slot, epoch, spin_limit, error_ptr, o, slot)
    tl.debug_barrier()  # the flags one thread acquired cover the parts every thread reads
    for first_col in tl.static_range(0, D_MODEL, BLOCK_N):
        cols = first_col + tl.arange(0, BLOCK_N)
        col_mask = cols < D_MODEL
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for o in tl.static_range(WORLD):
            has = tl.max((owner == o).to(tl.int32), axis=1) > 0
            at = (o * MAX_TOKENS + tokens).to(tl.int64)[:, None] * D_MODEL + cols[None, :]
            part = tl.load(parts_ptr + at, mask=has[:, None] & col_mask[None, :], other=0.0,
                           cache_modifier=".cg")  # peers wrote these: not from L1
            acc += part.to(tl.float32)
        tl.store(out_ptr + tokens.to(tl.int64)[:, None] * D_MODEL + cols[None, :], acc.to(OUT_DTYPE),
                 mask=token_mask[:, None] & col_mask[None, :])


@triton.jit
def _wait_rows(flags, kept, epoch, spin_limit, error_ptr):
    """Bounded spin until every kept flag of a [R, C] block holds at least `epoch`; returns what was seen (kept
    flags only; the others read as `epoch`). While an error is recorded (say, this launch's first timeout) it
    looks once: its result is lost anyway, and each program would otherwise spin the whole bound."""
    seen = tl.where(kept, tl.atomic_add(flags, tl.zeros(flags.shape, tl.int32), mask=kept, sem="acquire",
                                        scope="sys"), epoch)
    limit = _spin_limit_unless_failed(error_ptr, spin_limit)
    spins = 0
    while (tl.min(tl.min(seen, axis=1), axis=0) < epoch) & (spins < limit):
        seen = tl.where(kept, tl.atomic_add(flags, tl.zeros(flags.shape, tl.int32), mask=kept, sem="acquire",
                                            scope="sys"), epoch)
        spins += 1
    return seen


@triton.jit
def _report_late(seen, epoch, order, peer, slot, error_ptr):
    """After a bounded wait: if a flag is still below `epoch`, record (1, peer, slot) of the first late one."""
    late = seen < epoch
    if tl.max(tl.max(late.to(tl.int32), axis=1), axis=0) > 0:
        first = tl.min(tl.min(tl.where(late, order, 2147483647), axis=1), axis=0)
        record_timeout(error_ptr, 1, tl.min(tl.min(tl.where(order == first, peer, 2147483647), axis=1), axis=0),
                       tl.min(tl.min(tl.where(order == first, slot, 2147483647), axis=1), axis=0), epoch)


@triton.jit
def _comes_back(row, valid, num_rows, dest_row_ptr, capacity):
    """Whether an assignment's row comes back from its owner: kept (a dropped one points one past the last row) and
    below the owner's receive capacity (no tile computes a row past it: a bound that did not hold, see
    expert_layout's combine tiles)."""
    kept = valid & (row < num_rows)
    return kept & (tl.load(dest_row_ptr + row, mask=kept, other=0) < capacity)


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "capacity", "epoch", "spin_limit"])  # one variant
def _weighted_unpermute_kernel(rows_ptr, inverse_ptr, weights_ptr, tile_of_row_ptr, owner_of_row_ptr, dest_row_ptr,
                               ready_ptr, error_ptr, out_ptr, copy_ptr, num_tokens, num_rows, capacity, epoch,
                               spin_limit, D_MODEL: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               COPY_ROWS: tl.constexpr):
    """Program (token block, column block): wait for the tiles holding its rows, then the weighted sum; with
    COPY_ROWS also a copy of each assignment's row, token by token (zeros for one whose row does not come back:
    dropped, or past the owner's capacity)."""
    N_COL: tl.constexpr = (D_MODEL + BLOCK_N - 1) // BLOCK_N
    col = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    js = tl.arange(0, K_P2)
    assignment = tokens[:, None] * TOP_K + js[None, :]
    in_range = token_mask[:, None] & (js[None, :] < TOP_K)
    row = tl.load(inverse_ptr + assignment, mask=in_range, other=num_rows)
    kept = _comes_back(row, in_range, num_rows, dest_row_ptr, capacity)
    slot = tl.load(tile_of_row_ptr + row, mask=kept, other=0) * N_COL + col
    seen = _wait_rows(ready_ptr + slot, kept, epoch, spin_limit, error_ptr)
    owner = tl.load(owner_of_row_ptr + row, mask=kept, other=0)
    _report_late(seen, epoch, assignment, owner, slot, error_ptr)
    tl.debug_barrier()  # the flags this program's threads acquired cover the rows any of them reads
    cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D_MODEL
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # assignment order: the same sum on every run
        r = tl.load(inverse_ptr + tokens * TOP_K + j, mask=token_mask, other=num_rows)
        ok = _comes_back(r, token_mask, num_rows, dest_row_ptr, capacity)
        w = tl.load(weights_ptr + tokens * TOP_K + j, mask=ok, other=0.0)
        at = r[:, None] * D_MODEL + cols[None, :]
        x = tl.load(rows_ptr + at, mask=ok[:, None] & col_mask[None, :], other=0.0,
                    cache_modifier=".cg")  # peers wrote these rows: not from L1
        if COPY_ROWS:  # in assignment order (zeros where dropped), as the routing weights' gradient reads them
            tl.store(copy_ptr + (tokens * TOP_K + j).to(tl.int64)[:, None] * D_MODEL + cols[None, :], x,
                     mask=token_mask[:, None] & col_mask[None, :])
        acc += x.to(tl.float32) * w[:, None]
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * D_MODEL + cols[None, :], acc.to(OUT_DTYPE),
             mask=token_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["epoch"])  # one variant for all steps
def _acknowledge_kernel(ack_ptrs, rank, epoch, WORLD: tl.constexpr):
    signal_ready(ack_ptrs, rank, epoch, WORLD)


@triton.jit
def _gradient_tile(tiles_ptr, num_row_tiles, source_rank_ptr, FFN: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """This program's step of a gradient GEMM's walk (grouped order: tile_order) over the layout's
    combine_grad_tiles -> (local expert, receive rows, row mask, the rows' source ranks, ffn block)."""
    tile, col = grouped_tile(tl.program_id(0), num_row_tiles, (FFN + BLOCK_N - 1) // BLOCK_N)
    expert = tl.load(tiles_ptr + tile)
    rows = tl.load(tiles_ptr + num_row_tiles + tile) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(tiles_ptr + 2 * num_row_tiles + tile)
    return expert, rows, row_mask, tl.load(source_rank_ptr + rows, mask=row_mask, other=0), col


@triton.jit
def _wait_tile_rows(ready_ptr, slot, rows, row_mask, source, epoch, spin_limit, error_ptr):
    """Bounded wait for each row's flag `slot` (a late one recorded with its source and slot), then a barrier: the
    flags this program's threads acquired cover the rows any of them reads. Returns which rows' flags came."""
    seen = _wait_rows(ready_ptr + slot[:, None], row_mask[:, None], epoch, spin_limit, error_ptr)
    _report_late(seen, epoch, rows[:, None], source[:, None], slot[:, None], error_ptr)
    tl.debug_barrier()
    return tl.min(seen, axis=1) >= epoch


# one variant for all steps
@triton.jit(do_not_specialize=["num_rows", "num_blocks", "first_block", "slots_per_rank", "epoch", "spin_limit"])
def _push_gradient_kernel(grad_ptr, token_ptr, weight_ptr, dest_rank_ptr, dest_row_ptr, rows_ptrs, ready_ptrs,
                          ack_ptr, error_ptr, rank, num_rows, num_blocks, first_block, slots_per_rank, epoch,
                          spin_limit, D_MODEL: tl.constexpr, WORLD: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Program b: rows [b * BLOCK_R, ...) of this rank's permuted rows -> grad_y[token] * weight at their owners."""
    block = (tl.program_id(0) + first_block) % num_blocks
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r < num_rows
    ok = rows
    token = tl.load(token_ptr + r, mask=ok, other=0)
    weight = tl.load(weight_ptr + r, mask=ok, other=0.0)
    dest = tl.load(dest_rank_ptr + r, mask=ok, other=0)
    at = tl.load(dest_row_ptr + r, mask=ok, other=0)
    for peer in tl.static_range(WORLD):  # the guard: every owner has finished reading the previous epoch
        ok = ok & ((dest != peer) | consumer_released(ack_ptr, peer, epoch, spin_limit, error_ptr))
    out = tl.load(rows_ptrs + dest, mask=ok, other=0).to(tl.pointer_type(OUT_DTYPE))
    out = tl.multiple_of(out, 16)  # symmetric buffers are aligned: vector stores
    for k in range(0, D_MODEL, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (cols < D_MODEL)[None, :]
        g = tl.load(grad_ptr + token[:, None] * D_MODEL + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out[:, None] + at[:, None] * D_MODEL + cols[None, :], (g * weight[:, None]).to(OUT_DTYPE), mask=m)
    if tl.max((rows & ~ok).to(tl.int32), axis=0) == 0:  # no flag over rows not stored (an owner that never
        # released its buffer would read them of the epoch before as this one's)
        signal_ready(ready_ptrs, rank * slots_per_rank + block, epoch, WORLD)


@triton.jit(do_not_specialize=["num_row_tiles", "slots_per_rank", "epoch", "spin_limit"])  # one variant for all steps
def _gradient_gemm_kernel(g_ptr, w2_desc, out_ptr, tiles_ptr, source_rank_ptr, source_row_ptr, ready_ptr, error_ptr,
                          num_row_tiles, slots_per_rank, epoch, spin_limit,
                          FFN: tl.constexpr, D_MODEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row tile, ffn block), in grouped order (tile_order): grad_h = g @ w2[e]^T once the tile's rows have
    arrived. w2 [L, FFN, D_MODEL] comes through a TMA descriptor; g through pointers (peers wrote it, after flags)."""
    expert, rows, row_mask, source, col = _gradient_tile(tiles_ptr, num_row_tiles, source_rank_ptr, FFN, BLOCK_M,
                                                         BLOCK_N)
    n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = source * slots_per_rank + tl.load(source_row_ptr + rows, mask=row_mask, other=0) // BLOCK_R
    _wait_tile_rows(ready_ptr, slot, rows, row_mask, source, epoch, spin_limit, error_ptr)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D_MODEL, BLOCK_K):
        a = tl.load(g_ptr + rows[:, None] * D_MODEL + (k0 + ks)[None, :],
                    mask=row_mask[:, None] & (k0 + ks < D_MODEL)[None, :], other=0.0,
                    cache_modifier=".cg")  # peers wrote these rows: not from L1
        b = transposed_weight_tile(w2_desc, expert, col * BLOCK_N, k0, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * FFN + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (n < FFN)[None, :])


# -- the backward by token: grad_y crosses once per (token, owner); the routing weights' gradient comes back --------
@triton.jit(do_not_specialize=["num_tokens", "num_rows", "token_blocks", "epoch", "spin_limit"])  # one variant
def _push_token_gradients_kernel(grad_ptr, inverse_ptr, owner_of_row_ptr, dest_order_ptr, tokens_ptrs, ready_ptrs,
                                 ack_ptr, error_ptr, rank, num_tokens, num_rows, token_blocks, epoch, spin_limit,
                                 D_MODEL: tl.constexpr, MAX_TOKENS: tl.constexpr, TOP_K: tl.constexpr,
                                 K_P2: tl.constexpr, WORLD: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
    """Program (token block b, rank dest_order[i]), ranks interleaved (remote first, rotated, this rank last):
    grad_y[t] of the block's tokens that chose an expert of that rank, once each, at [this rank, t] of its
    gradient token buffer; then flag (this rank, b) there, raised for every block of this call's tokens (with or
    without rows). This rank's own slot is a local copy: the owner's GEMM reads every row from one buffer."""
    pid = tl.program_id(0)
    dest = tl.load(dest_order_ptr + pid % WORLD)
    block = pid // WORLD
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    owner = _owners_of_assignments(tokens, num_tokens, inverse_ptr, owner_of_row_ptr, num_rows, TOP_K, K_P2)
    chose = tl.max((owner == dest).to(tl.int32), axis=1) > 0
    released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
    mask = token_mask & chose & released
    out = tl.load(tokens_ptrs + dest).to(tl.pointer_type(grad_ptr.dtype.element_ty))
    out = tl.multiple_of(out, 16)  # symmetric buffers are aligned: vector stores
    at = (rank * MAX_TOKENS + tokens).to(tl.int64)
    for k in range(0, D_MODEL, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        m = mask[:, None] & (cols < D_MODEL)[None, :]
        g = tl.load(grad_ptr + tokens.to(tl.int64)[:, None] * D_MODEL + cols[None, :], mask=m)
        tl.store(out + at[:, None] * D_MODEL + cols[None, :], g, mask=m)
    if released:
        signal_peer(ready_ptrs, dest, rank * token_blocks + block, epoch)


@triton.jit(do_not_specialize=["num_row_tiles", "token_blocks", "epoch", "spin_limit"])  # one variant for all steps
def _gradient_gemm_by_token_kernel(tokens_ptr, w2_desc, y_ptr, weight_of_row_ptr, token_of_row_ptr,
                                   out_ptr, g_out_ptr, weight_grad_ptrs, tiles_ptr, source_rank_ptr, source_row_ptr,
                                   ready_ptr, error_ptr, num_row_tiles, token_blocks, epoch, spin_limit,
                                   FFN: tl.constexpr, D_MODEL: tl.constexpr, MAX_TOKENS: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row tile, ffn block), in grouped order (tile_order): receive row R (source s, token t, weight w)
    has the gradient g_R = w * grad_y_s[t], grad_y_s[t] read from [s, t] of the gradient token buffer once flag
    (s, t's block) is up; grad_h = w * (grad_y_s[t] @ w2[e]^T). The tiles of the first ffn block also store g (for
    grad_w2 = h^T g) and the routing weight's gradient <grad_y_s[t], y_R> (y: GEMM 2's forward output, kept here)
    at s's permuted row of R in s's weight-gradient words, with the epoch in the word's high half (no flag: the
    word is its own)."""
    expert, rows, row_mask, source, col = _gradient_tile(tiles_ptr, num_row_tiles, source_rank_ptr, FFN, BLOCK_M,
                                                         BLOCK_N)
    n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0)
    weight = tl.load(weight_of_row_ptr + rows, mask=row_mask, other=0.0)
    arrived = _wait_tile_rows(ready_ptr, source * token_blocks + token // BLOCK_T, rows, row_mask, source, epoch,
                              spin_limit, error_ptr)
    g_rows = tokens_ptr + (source.to(tl.int64) * MAX_TOKENS + token.to(tl.int64)) * D_MODEL
    ks = tl.arange(0, BLOCK_K)
    if col == 0:  # in a loop of its own, before the GEMM's (a branch inside that loop would keep it from pipelining)
        dots = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, D_MODEL, BLOCK_K):
            m = row_mask[:, None] & (k0 + ks < D_MODEL)[None, :]
            g = tl.load(g_rows[:, None] + (k0 + ks)[None, :], mask=m, other=0.0, cache_modifier=".cg")
            at = rows.to(tl.int64)[:, None] * D_MODEL + (k0 + ks)[None, :]
            y = tl.load(y_ptr + at, mask=m, other=0.0)
            dots += tl.sum(g.to(tl.float32) * y.to(tl.float32), axis=1)
            tl.store(g_out_ptr + at, (g.to(tl.float32) * weight[:, None]).to(g.dtype), mask=m)
        words = tl.load(weight_grad_ptrs + source, mask=row_mask, other=0).to(tl.pointer_type(tl.int64))
        bits = dots.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        word = (epoch.to(tl.int64) << 32) | bits
        # None for a row whose gradient never came (the wait gave up): the source, late, would take its epoch's
        # word for the row's gradient; it times out naming this rank instead.
        tl.store(words + tl.load(source_row_ptr + rows, mask=row_mask, other=0), word, mask=row_mask & arrived)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D_MODEL, BLOCK_K):
        a = tl.load(g_rows[:, None] + (k0 + ks)[None, :], mask=row_mask[:, None] & (k0 + ks < D_MODEL)[None, :],
                    other=0.0, cache_modifier=".cg")  # peers wrote these rows: not from L1
        b = transposed_weight_tile(w2_desc, expert, col * BLOCK_N, k0, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    acc = acc * weight[:, None]  # the row's weight after the product: a row scale commutes with it
    tl.store(out_ptr + rows[:, None] * FFN + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (n < FFN)[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "epoch", "spin_limit"])  # one variant for all steps
def _routing_weight_grads_kernel(words_ptr, inverse_ptr, owner_of_row_ptr, out_ptr, error_ptr, num_tokens, num_rows,
                                 epoch, spin_limit, TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program b: tokens [b * BLOCK_T, ...) of this rank: out[t, j] = the gradient the owner of assignment (t, j)
    stored in this rank's word of its permuted row, once the word carries this epoch (bounded spin; a late one
    names its owner and row); 0 for a dropped assignment."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    js = tl.arange(0, K_P2)
    assignment = tokens[:, None] * TOP_K + js[None, :]
    in_range = (tokens < num_tokens)[:, None] & (js < TOP_K)[None, :]
    row = tl.load(inverse_ptr + assignment, mask=in_range, other=num_rows)
    kept = row < num_rows  # dropped assignments point one past the last row
    word = tl.atomic_add(words_ptr + row, tl.zeros(row.shape, tl.int64), mask=kept, sem="relaxed", scope="sys")
    # A timeout recorded already (not yet read by the host): look once, as peer_flags' waits do.
    limit = tl.where(tl.atomic_add(error_ptr, 0) != 0, 0, spin_limit)
    spins = 0
    while (tl.max(tl.max(tl.where(kept, (word >> 32) != epoch, False).to(tl.int32), axis=1), axis=0) > 0) \
            & (spins < limit):
        word = tl.atomic_add(words_ptr + row, tl.zeros(row.shape, tl.int64), mask=kept, sem="relaxed", scope="sys")
        spins += 1
    owner = tl.load(owner_of_row_ptr + row, mask=kept, other=0)
    _report_late(tl.where(kept & ((word >> 32) != epoch), epoch - 1, epoch), epoch, assignment, owner, row,
                 error_ptr)
    grad = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_ptr + assignment, tl.where(kept, grad, 0.0), mask=in_range)


class FusedCombine:
    """Expert GEMM 2 + the combine all-to-all + the weighted unpermute, on a symmetric workspace.

    Every rank calls `reserve` (whenever the rows to combine may have grown), then `start` (owner side) and `finish`
    (source side) once per epoch, in the same order, with the epoch's DispatchTables; in a simulated world every
    rank's `start` runs before any `finish`. The backward (`start_backward`, `finish_backward`) takes the
    ExpertLayout.
    """

    def __init__(self, workspace: _Workspace, d_model: int, num_local_experts: int, num_programs: int,
                 spin_limit: int, max_tokens: int | None = None, top_k: int = 1):
        self.ws = workspace
        self.rank, self.world = workspace.rank, workspace.world_size
        self.d_model, self.num_local_experts = d_model, num_local_experts
        self.num_programs, self.spin_limit = num_programs, spin_limit
        self.blocks = combine_blocks(workspace.device)
        self.num_col = triton.cdiv(d_model, self.blocks.block_n)
        self.errors = PeerErrors(workspace.device, self.rank, "fused MoE combine")
        self._plan: CombinePlan | None = None
        self._grad: tuple | None = None  # (layout, dtype, rows, ready, ack, slots per rank, tiles) of the backward
        self._rows_capacity = 0  # rows of the combine's receive buffer (each source's own rows)
        self._slots = 0  # flag slots per column block of that buffer
        self._grad_capacity = 0  # the owners' gradient rows: grown as the dispatch's receive capacity is
        self.max_tokens = max_tokens  # the combine by token (start_by_token): the most tokens of any source,
        self.top_k = top_k  # and the experts of each token
        if max_tokens is not None:
            if max_tokens < 1 or top_k < 1:
                raise ValueError(f"max_tokens={max_tokens} and top_k={top_k} must be positive")
            self._token_blocks = triton.cdiv(max_tokens, self.blocks.part_tokens)
            self._sum_launches = CompiledLaunches(_sum_token_rows_kernel)
            self._source_order = torch.tensor(remote_first_order(self.rank, self.world), dtype=torch.int32,
                                              device=workspace.device)
            # rows_of_token[s, t, e]: the receive row of source s's token t at local expert e, or -1
            self._rows_of_token = torch.empty(self.world * max_tokens * num_local_experts, dtype=torch.int32,
                                              device=workspace.device)
            self._token_sum: TokenSum | None = None
            self._token_grad: TokenGradients | None = None
            self._token_dtype = torch.float32
            # The sum by token's [next ticket, items done] (`_sum_token_rows_kernel`, which leaves them at 0).
            self._counters = torch.zeros(2, dtype=torch.int32, device=workspace.device)

    def reserve(self, max_send_rows: int, max_send_slots: int, total_rows: int = 0) -> None:
        """Combine buffers for `max_send_rows` permuted rows and `max_send_slots` flag slots (expert_layout.send_slots)
        per source, the most of any rank (the same on every rank), with room to spare up to `total_rows` when they
        grow (`receive_capacity`); never shrinking. The buffers are made (a collective on GPUs) by the next
        `start`."""
        self._rows_capacity = receive_capacity(max_send_rows, self._rows_capacity, total_rows)
        self._slots = max(self._slots, triton.next_power_of_2(max(max_send_slots, 1)))

    def start(self, h: torch.Tensor, w2: torch.Tensor, tables: DispatchTables) -> int:
        """h [tables.capacity, ffn] in receive order (its first rows the ones received), w2 [local experts, ffn,
        d_model] (h's dtype): enqueue the GEMM whose tiles land in their sources' combine buffers, over the tiles
        that tables.combine_tiles lists (the GPU reads how many). Returns the epoch to pass to `finish`."""
        self._check_gemm_inputs(h, w2, tables)
        if tables.send_tile.numel() > self._rows_capacity:
            raise ValueError(f"{tables.send_tile.numel()} rows to combine; {self._rows_capacity} reserved (reserve "
                             f"first, for the most rows any rank sends)")
        plan = self._plan = CombinePlan(tables, h.dtype, *self._buffers(h.dtype))
        epoch = self.ws.next_epoch("combine")
        self._expert_down(h, w2, tables, epoch, plan.rows.peer_ptrs, plan.ready.peer_ptrs, plan.ack.local)
        return epoch

    def start_by_token(self, h: torch.Tensor, w2: torch.Tensor, tables: DispatchTables,
                       sources: tuple[torch.Tensor, torch.Tensor], perm: Permutation) -> int:
        """The combine by token (needs `max_tokens`): GEMM 2 over h (as `start`) into a local y, then one kernel
        (`_sum_token_rows_kernel`) of items (token block, source): per (source, token) the weighted sum of the
        token's rows here, stored at [this rank, token] of the source's parts buffer with a flag per (this rank,
        token block) in each peer; and, in the items of this rank's own tokens, the sum of every owner's parts once
        their flags are up. In a simulated world (ranks one after another) this launch runs the peers' items only
        and `finish_by_token` the own ones. `sources`: the peers' rows' (token ids, routing weights) [world,
        max_rows] (FusedDispatch.rows_by_source); this rank's own rows' from perm.token_of_row and
        perm.row_weights (`permutation` given the routing weights). Returns the epoch for `finish_by_token`."""
        if self.max_tokens is None:
            raise RuntimeError("start_by_token: this combine was made without max_tokens")
        self._check_gemm_inputs(h, w2, tables)
        if perm.top_k > self.top_k:  # a token's rows per owner, and the peers' id and word buffers, are sized by it
            raise ValueError(f"a permutation of top_k={perm.top_k}: this combine was made for {self.top_k}")
        row_tokens, source_weights = sources
        max_rows = self.max_tokens * self.top_k
        token_of_row, row_weights = perm.token_of_row, _row_weights(perm, "start_by_token")
        if (row_tokens.shape != (self.world, max_rows) or source_weights.shape != row_tokens.shape
                or row_tokens.dtype != torch.int32 or source_weights.dtype != torch.float32):
            raise ValueError(f"sources must be int32 token ids and fp32 weights [{self.world}, max_tokens x top_k = "
                             f"{max_rows}]")
        num_tokens = perm.inverse.numel() // perm.top_k
        if num_tokens > self.max_tokens:
            raise ValueError(f"rank {self.rank}: {num_tokens} tokens, more than the combine's max_tokens="
                             f"{self.max_tokens}")
        self._token_buffers(h.dtype)
        epoch = self.ws.next_epoch("combine")
        b, width = self.blocks, tables.combine_tiles.shape[1]
        owner = OwnerRows(h.new_empty(h.shape[0], self.d_model),
                          torch.empty(h.shape[0], dtype=torch.float32, device=h.device),
                          torch.empty(h.shape[0], dtype=torch.int32, device=h.device))
        self._rows_of_token.fill_(-1)  # tokens without a row here this epoch (the sum reads every token's entries)
        if width:
            _rows_of_tokens_kernel[(width,)](
                tables.combine_tiles, tables.combine_row_tiles, width, row_tokens, source_weights,
                token_of_row.contiguous(), row_weights.contiguous(), self._rows_of_token, owner.weight, owner.token,
                self.rank, BLOCK_M=b.block_m, MAX_TOKENS=self.max_tokens, MAX_ROWS=max_rows,
                L=self.num_local_experts)
        self._expert_down(h, w2, tables, epoch, y=owner.y)
        out = torch.empty(num_tokens, self.d_model, dtype=h.dtype, device=h.device)
        self._token_sum = TokenSum(tables, perm, owner, out)
        # One launch where ranks run at once; a simulated world runs the own items (which wait for the peers')
        # after every rank's start.
        self._sum_token_rows(epoch, 0, self.world - 1 if self.ws.simulated else self.world)
        return epoch

    def finish_by_token(self, epoch: int, tables: DispatchTables,
                        perm: Permutation) -> tuple[torch.Tensor, OwnerRows]:
        """The combine by token, source side -> ([tokens, d_model] in h's dtype, what this rank as owner keeps for
        a backward by token): per token the sum (fp32, in rank order) of the parts of the owners that hold its
        experts (the items of `start_by_token`'s launch; in a simulated world launched here); the launch with
        those items acknowledges the epoch to every owner."""
        plan = self._token_sum
        if plan is None or plan.tables is not tables or plan.perm is not perm:
            raise RuntimeError("finish_by_token must follow start_by_token with the same tables and permutation")
        if self.ws.simulated:
            self._sum_token_rows(epoch, self.world - 1, 1)
        self._token_sum = None
        self.errors.after_wait()
        return plan.out, plan.owner

    def _sum_token_rows(self, epoch: int, first: int, sources: int) -> None:
        """Launch the items of sources source_order[first : first + sources] of every token block (the launch
        with the own items, the last source, acknowledges the epoch)."""
        if not sources:
            return
        plan, perm = self._token_sum, self._token_sum.perm
        parts, ready, ack = self._token_buffers(self._token_dtype)
        b, L = self.blocks, self.num_local_experts
        tensors = (plan.owner.y, self._rows_of_token, plan.owner.weight, self._source_order, parts.peer_ptrs,
                   ready.peer_ptrs, ack.peer_ptrs, perm.inverse, plan.tables.send_dest_rank, plan.out, self._counters,
                   self.errors.word)
        args = (*tensors, self.rank, self._token_blocks, plan.out.shape[0], plan.tables.send_dest_rank.numel(), epoch,
                self.spin_limit, self.d_model, self.max_tokens, self.world, L, triton.next_power_of_2(L),
                min(self.top_k, L), perm.top_k, triton.next_power_of_2(perm.top_k), b.part_tokens, b.part_cols,
                TL_DTYPES[self._token_dtype], first, sources, first + sources == self.world)
        key = (self._token_dtype, first, sources, perm.top_k, *map(aligned, tensors))
        self._sum_launches(key, (sources * self._token_blocks, 1, 1), args, dict(num_warps=b.consumer_warps))

    def _check_gemm_inputs(self, h: torch.Tensor, w2: torch.Tensor, tables: DispatchTables) -> None:
        self.errors.check()
        if w2.shape != (self.num_local_experts, h.shape[1], self.d_model) or w2.dtype != h.dtype:
            raise ValueError(f"w2 {tuple(w2.shape)} {w2.dtype} does not fit h {tuple(h.shape)} {h.dtype}")
        if h.shape[0] != tables.capacity:
            raise ValueError(f"h has {h.shape[0]} rows; the tables cover {tables.capacity}")
        if tables.tile_rows[0] != self.blocks.block_m:
            raise ValueError(f"the tables cut tiles of {tables.tile_rows[0]} rows; this combine's flags number tiles "
                             f"of {self.blocks.block_m} (dispatch_tables(..., tile_rows=combine.blocks.block_m))")
        require_tma_readable(w2.contiguous(), "w2")  # the backward reads it through TMA

    def _expert_down(self, h: torch.Tensor, w2: torch.Tensor, tables: DispatchTables, epoch: int,
                     out_ptrs: torch.Tensor | None = None, ready_ptrs: torch.Tensor | None = None,
                     ack: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
        """GEMM 2 over the tiles tables.combine_tiles lists: into the sources' buffers (out_ptrs, with flags and
        the ack guard) or, given y, into y on this rank."""
        tiles = tables.combine_tiles
        if not tiles.shape[1]:
            return
        b = self.blocks
        grid = min(self.num_programs, tiles.shape[1] * self.num_col)
        block_k, stages = _gemm_steps(b, h.dtype, h.is_cuda)
        local = y is not None
        exchange = (y, y, y) if local else (out_ptrs, ready_ptrs, ack)  # a local store reads none of them
        _expert_down_kernel[(grid,)](
            h.contiguous(), w2.contiguous(), tiles, tables.combine_row_tiles, *exchange, self.errors.word,
            y if local else h, tiles.shape[1], grid, epoch, self.spin_limit,
            FFN=h.shape[1], D_MODEL=self.d_model, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=block_k,
            OUT_DTYPE=TL_DTYPES[h.dtype], PRECISION=dot_precision(h.dtype, h.device), STORE_LOCAL=local,
            num_warps=b.gemm_warps, num_stages=stages)

    def finish(self, epoch: int, tables: DispatchTables, perm: Permutation, weights: torch.Tensor,
               rows_out: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, d_model] in h's dtype: per token the weighted sum (fp32) of its k expert outputs, each block
        of tokens read as soon as the owners' flags of its rows are up. `rows_out` ([tokens * top_k, d_model],
        h's dtype), if given, receives each assignment's expert output row in assignment order (token t's j-th at
        t * top_k + j; zeros for a dropped one): the routing weights' gradient needs them, and the combine buffer
        itself is the owners' again once `finish` acknowledges the epoch."""
        if self._plan is None or self._plan.tables is not tables:
            raise RuntimeError("finish must follow start with the same tables")
        plan = self._plan
        num_tokens, top_k = _tokens(perm, "weights", weights, perm.top_k), perm.top_k
        if rows_out is not None and (rows_out.shape != (weights.numel(), self.d_model)
                                     or rows_out.dtype != plan.dtype or not rows_out.is_contiguous()):
            raise ValueError(f"rows_out must be a contiguous [{weights.numel()}, {self.d_model}] {plan.dtype} "
                             f"tensor, got {tuple(rows_out.shape)} {rows_out.dtype}")
        out = torch.empty(num_tokens, self.d_model, dtype=plan.dtype, device=weights.device)
        if num_tokens:
            b = self.blocks
            grid = (triton.cdiv(num_tokens, b.block_tokens), self.num_col)
            _weighted_unpermute_kernel[grid](
                plan.rows.local, perm.inverse, weights.float().contiguous(), tables.send_tile,
                tables.send_dest_rank, tables.send_dest_row, plan.ready.local, self.errors.word, out,
                out if rows_out is None else rows_out, num_tokens, tables.send_dest_rank.numel(), tables.capacity,
                epoch, self.spin_limit,
                D_MODEL=self.d_model, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
                BLOCK_T=b.block_tokens, BLOCK_N=b.block_n, OUT_DTYPE=TL_DTYPES[plan.dtype],
                COPY_ROWS=rows_out is not None, num_warps=b.consumer_warps)
        _acknowledge_kernel[(1,)](plan.ack.peer_ptrs, self.rank, epoch, WORLD=self.world)
        self.errors.after_wait()
        return out

    def start_backward(self, grad_y: torch.Tensor, perm: Permutation, layout: ExpertLayout) -> int:
        """Source side of the backward: each permuted row's gradient grad_y[token] * its routing weight
        (perm.row_weights: `permutation` given the weights) goes to row `send_dest_row` of its owner's gradient
        buffer, flags raised per (this rank, row block). Every rank calls `start_backward` before any rank calls
        `finish_backward`. Returns the epoch."""
        self.errors.check()
        _tokens(perm, "grad_y", grad_y, self.d_model)
        row_weights = _row_weights(perm, "start_backward")
        counts = layout.host_counts
        rows, ready, ack, slots = self._gradient_buffers(layout, grad_y.dtype)
        epoch = self.ws.next_epoch("combine_grad")
        num_rows = layout.send_dest_rank.numel()
        if num_rows:
            b = self.blocks
            num_blocks = triton.cdiv(num_rows, b.block_rows)
            # Remote first: start with the rows of rank + 1 (rows are grouped by owner), wrap around to this rank.
            before_next = int(counts[self.rank, :(self.rank + 1) * self.num_local_experts].sum())
            _push_gradient_kernel[(num_blocks,)](
                grad_y.contiguous(), perm.token_of_row, row_weights,
                layout.send_dest_rank, layout.send_dest_row, rows.peer_ptrs, ready.peer_ptrs, ack.local,
                self.errors.word, self.rank, num_rows, num_blocks, before_next // b.block_rows, slots, epoch,
                self.spin_limit, D_MODEL=self.d_model, WORLD=self.world, BLOCK_R=b.block_rows, BLOCK_D=b.block_d,
                OUT_DTYPE=TL_DTYPES[grad_y.dtype])
        return epoch

    def finish_backward(self, epoch: int, layout: ExpertLayout, h: torch.Tensor, w2: torch.Tensor,
                        weight_grad_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner side: (grad_h = g @ w2[e]^T [received rows, ffn], grad_w2 = h^T g [local experts, ffn, d_model]
        in weight_grad_dtype, None: h's) for the received gradient rows g, each GEMM tile waiting for the flags of
        its rows; then the epoch is acknowledged to every source."""
        if self._grad is None or self._grad[0] is not layout:
            raise RuntimeError("finish_backward must follow start_backward with the same layout")
        _, dtype, rows, ready, ack, slots, tiles = self._grad
        sizes = layout.tokens_per_local_expert
        received, ffn = sum(sizes), h.shape[1]
        g = rows.local[:received * self.d_model].view(received, self.d_model)
        grad_h = torch.empty(received, ffn, dtype=dtype, device=h.device)
        b = self.blocks
        if tiles.shape[1]:
            block_k, stages = _gemm_steps(b, dtype, h.is_cuda)
            w2_tiles = descriptor(w2.contiguous(), [1, b.block_n, block_k], "w2")
            _gradient_gemm_kernel[(tiles.shape[1] * triton.cdiv(ffn, b.block_n),)](
                rows.local, w2_tiles, grad_h, tiles, layout.recv_source_rank, layout.recv_source_row, ready.local,
                self.errors.word, tiles.shape[1], slots, epoch, self.spin_limit, FFN=ffn, D_MODEL=self.d_model,
                BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=block_k, BLOCK_R=b.block_rows,
                PRECISION=dot_precision(dtype, h.device),
                num_warps=b.gemm_warps, num_stages=stages)
        # stream order: after the kernel saw every row's flag
        grad_w2 = grouped_weight_grad(h, g, sizes, weight_grad_dtype)
        _acknowledge_kernel[(1,)](ack.peer_ptrs, self.rank, epoch, WORLD=self.world)
        self.errors.after_wait()
        return grad_h, grad_w2

    def start_backward_by_token(self, grad_y: torch.Tensor, perm: Permutation, layout: ExpertLayout) -> int:
        """Source side of the backward by token (after a forward by token): grad_y[t] once to each rank that holds
        an expert of t (this one included: a local copy), at [this rank, t] of its gradient token buffer, a flag
        per (this rank, token block) there. Every rank calls it before any rank calls `finish_backward_by_token`.
        Returns the epoch."""
        self.errors.check()
        if self.max_tokens is None:
            raise RuntimeError("start_backward_by_token: this combine was made without max_tokens")
        num_tokens = _tokens(perm, "grad_y", grad_y, self.d_model)
        tokens, ready, ack, _ = self._token_gradient_buffers(grad_y.dtype)
        grad_y = grad_y.contiguous()
        epoch = self.ws.next_epoch("combine_grad")  # shared with the backward by row: one ack buffer
        blocks = triton.cdiv(num_tokens, self.blocks.part_tokens)
        if blocks:
            _push_token_gradients_kernel[(self.world * blocks,)](
                grad_y, perm.inverse, layout.send_dest_rank, self._source_order, tokens.peer_ptrs, ready.peer_ptrs,
                ack.local, self.errors.word, self.rank, num_tokens, layout.send_dest_rank.numel(),
                self._token_blocks, epoch, self.spin_limit, D_MODEL=self.d_model, MAX_TOKENS=self.max_tokens,
                TOP_K=perm.top_k, K_P2=triton.next_power_of_2(perm.top_k), WORLD=self.world,
                BLOCK_T=self.blocks.part_tokens, BLOCK_D=self.blocks.block_d)
        self._token_grad = TokenGradients(layout, perm, grad_y, epoch)
        return epoch

    def finish_backward_by_token(self, epoch: int, layout: ExpertLayout, h: torch.Tensor, w2: torch.Tensor,
                                 owner: OwnerRows,
                                 weight_grad_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner side: (grad_h, grad_w2) as `finish_backward`, each received row's gradient w * grad_y[t] read
        through its token (`owner`: what `finish_by_token` returned in the forward), each GEMM tile waiting for the
        flags of its rows' token blocks; the tiles also send each row's routing weight gradient <grad_y[t], y> to
        its source (`routing_weights_grad_by_token`). Then the epoch is acknowledged to every source."""
        plan = self._token_grad
        if plan is None or plan.layout is not layout or plan.epoch != epoch:
            raise RuntimeError("finish_backward_by_token must follow start_backward_by_token with the same layout")
        tokens, ready, ack, words = self._token_gradient_buffers(plan.grad_y.dtype)
        sizes = layout.tokens_per_local_expert
        received, ffn = sum(sizes), h.shape[1]
        if owner.y.shape[0] < received or h.shape[0] != received:
            raise ValueError(f"h has {h.shape[0]} rows and the forward's owner rows {owner.y.shape[0]}; "
                             f"{received} rows were received")
        dtype = plan.grad_y.dtype
        grad_h = torch.empty(received, ffn, dtype=dtype, device=h.device)
        g = torch.empty(received, self.d_model, dtype=dtype, device=h.device)  # w * grad_y[t], for grad_w2
        tiles = layout.combine_grad_tiles
        if tiles.shape[1]:
            b = self.blocks
            block_k, stages = _gemm_steps(b, dtype, h.is_cuda)
            w2_tiles = descriptor(w2.contiguous(), [1, b.block_n, block_k], "w2")
            _gradient_gemm_by_token_kernel[(tiles.shape[1] * triton.cdiv(ffn, b.block_n),)](
                tokens.local, w2_tiles, owner.y, owner.weight, owner.token, grad_h, g, words.peer_ptrs,
                tiles, layout.recv_source_rank, layout.recv_source_row, ready.local, self.errors.word,
                tiles.shape[1], self._token_blocks, epoch, self.spin_limit, FFN=ffn, D_MODEL=self.d_model,
                MAX_TOKENS=self.max_tokens, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=block_k,
                BLOCK_T=b.part_tokens, PRECISION=dot_precision(dtype, h.device),
                num_warps=b.gemm_warps, num_stages=stages)
        # stream order: after the kernel saw every row's flag
        grad_w2 = grouped_weight_grad(h, g, sizes, weight_grad_dtype)
        _acknowledge_kernel[(1,)](ack.peer_ptrs, self.rank, epoch, WORLD=self.world)
        self.errors.after_wait()
        return grad_h, grad_w2

    def routing_weights_grad_by_token(self, epoch: int, perm: Permutation) -> torch.Tensor:
        """Source side, after every owner's `finish_backward_by_token` was enqueued: the gradient of the routing
        weights [tokens, top_k] (fp32; 0 where dropped), <grad_y[t], y of assignment (t, j)>, which the owners
        stored into this rank's words (a bounded wait for each)."""
        plan = self._token_grad
        if plan is None or plan.perm is not perm or plan.epoch != epoch:
            raise RuntimeError("routing_weights_grad_by_token must follow start_backward_by_token with the same "
                               "permutation")
        self._token_grad = None
        words = self._token_gradient_buffers(plan.grad_y.dtype)[3]
        num_tokens = perm.inverse.numel() // perm.top_k
        out = torch.empty(num_tokens, perm.top_k, dtype=torch.float32, device=plan.grad_y.device)
        if num_tokens:
            block = self.blocks.part_tokens
            _routing_weight_grads_kernel[(triton.cdiv(num_tokens, block),)](
                words.local, perm.inverse, plan.layout.send_dest_rank, out, self.errors.word, num_tokens,
                plan.layout.send_dest_rank.numel(), epoch, self.spin_limit, TOP_K=perm.top_k,
                K_P2=triton.next_power_of_2(perm.top_k), BLOCK_T=block)
        self.errors.after_wait()
        return out

    def _token_gradient_buffers(self, dtype: torch.dtype):
        """The backward by token's gradient tokens [source, max_tokens, d_model], their flags per (source, token
        block), the acks (shared with the backward by row) and the routing weights' gradient words [max_tokens x
        top_k] (int64: epoch << 32 | fp32 bits), by the source's permuted row."""
        return (self.ws.buffer("combine_grad_tokens", self.world * self.max_tokens * self.d_model, dtype),
                self.ws.buffer("combine_grad_tokens_ready", self.world * self._token_blocks, torch.int32),
                self.ws.buffer("combine_grad_ack", self.world, torch.int32),
                self.ws.buffer("combine_weight_grads", self.max_tokens * self.top_k, torch.int64))

    def _gradient_buffers(self, layout: ExpertLayout, dtype: torch.dtype):
        """The owners' gradient rows (receive order), flags per (source, row block), acks, from the layout's
        maxima (the same on every rank); and the owner GEMM's row tiles (local expert, first row, end)."""
        slots = triton.next_power_of_2(max(1, triton.cdiv(layout.max_send_rows, self.blocks.block_rows)))
        self._grad_capacity = receive_capacity(layout.max_recv_rows, self._grad_capacity, layout.total_rows)
        rows = self.ws.buffer("combine_grad_rows", self._grad_capacity * self.d_model, dtype)
        ready = self.ws.buffer(f"combine_grad_ready_{slots}", self.world * slots, torch.int32)
        ack = self.ws.buffer("combine_grad_ack", self.world, torch.int32)
        self._grad = (layout, dtype, rows, ready, ack, slots, layout.combine_grad_tiles)
        return rows, ready, ack, slots

    def _token_buffers(self, dtype: torch.dtype):
        """The combine by token's parts [owner, max_tokens, d_model], its flags per (owner, token block) and the
        acks (shared with the combine by row: both count the same epochs)."""
        self._token_dtype = dtype
        parts = self.ws.buffer("combine_parts", self.world * self.max_tokens * self.d_model, dtype)
        ready = self.ws.buffer("combine_parts_ready", self.world * self._token_blocks, torch.int32)
        return parts, ready, self.ws.buffer("combine_ack", self.world, torch.int32)

    def _buffers(self, dtype: torch.dtype):
        """The combine rows, the flags and the acks of the reserved sizes (the same on every rank)."""
        rows = self.ws.buffer("combine_rows", self._rows_capacity * self.d_model, dtype)
        # Flags are never reset, so a larger flag buffer is a new one; zeros read as "not ready" for any epoch.
        ready = self.ws.buffer(f"combine_ready_{self._slots}", self._slots * self.num_col, torch.int32)
        ack = self.ws.buffer("combine_ack", self.world, torch.int32)
        return rows, ready, ack


def _tokens(perm: Permutation, what: str, tensor: torch.Tensor, cols: int) -> int:
    """The permutation's tokens, once `tensor` (`what`) is [tokens, cols]: the kernels index it by the permutation's
    tokens, and one of another shape would be read past its end or in part."""
    tokens = perm.inverse.numel() // perm.top_k
    if tensor.shape != (tokens, cols):
        raise ValueError(f"{what} {tuple(tensor.shape)}: expected [{tokens}, {cols}] (the permutation's tokens)")
    return tokens


def _row_weights(perm: Permutation, caller: str) -> torch.Tensor:
    """perm.row_weights, which the combine by token and the backward scale rows by; refused where the permutation
    was made without the routing weights."""
    if perm.row_weights is None:
        raise ValueError(f"{caller} needs the rows' routing weights: permutation(..., weights)")
    return perm.row_weights
