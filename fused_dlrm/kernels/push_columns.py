"""Push column blocks of a local [rows, columns] tensor straight into peers' buffers, with ready flags.

The backward of the fused embedding all-to-all: each rank holds the gradient of its local batch for every feature
([local batch, sum of dims], config column order) and stores the columns of each feature, times a scale (torchrec's
division of the gradient by the world size, on the way instead of a pass of its own), into the owner's gradient
buffer ([global batch, owned dims], the owner's lookup order) at the rows of its own samples.
`push_columns_reference` is the pure-torch definition. Transports: p2p stores through peer pointers; nvshmem
stores local tiles and puts remote ones row by row from a symmetric copy of the source (nvshmem_puts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, aligned
from fused_dlrm.kernels.nvshmem_puts import nvshmem_kernel, put_rows, signal_ready_nvshmem
from fused_dlrm.kernels.peer_flags import released_once_per_dest, signal_ready
from fused_dlrm.kernels.peer_tiles import PeerTilePlan, next_tile_group, program_walk, tile_coords


def push_columns_reference(src: torch.Tensor, src_cols: list[int], dims: list[int], dst: torch.Tensor,
                           dst_row_base: int, dst_cols: list[int], scale: float = 1.0) -> None:
    """dst[dst_row_base + i, dst_cols[f] + c] = src[i, src_cols[f] + c] * scale for every feature f."""
    for s, d, n in zip(src_cols, dst_cols, dims):
        dst[dst_row_base:dst_row_base + src.shape[0], d:d + n] = src[:, s:s + n] * scale


@dataclass(frozen=True)
class GradientDestinations:
    """Where a kernel that makes the gradient of the fused exchange's output stores it itself (the pairwise
    interaction's backward: kernels/pairwise_interaction.py), in this push's protocol: with the output row seen as
    features, each cut in blocks of columns, block k of feature f of a local sample b's row goes, times `scale`,
    to rank r = block_dest[k, f]'s buffer out_ptrs[r], row out_row_base[r] + b (rows of out_row_len[r] fp32
    values), columns from block_dst[k, f] on; once ack[r] >= epoch - 1 (the owner released that half); then
    ready flags `rank * num_programs + slot`, every slot below `num_programs`, rise in every rank after the stores
    behind them (the owners' wait counts on all of them). Made per backward by the exchange
    (sparse/fused_all_to_all.py: GradientPush).

    With row blocks the exchange's row is wider than the kernel's (sparse/row_wise.py: each later block's part of a
    feature at a feature of its own after the real row, summed per sample after the exchange): then the block
    tables cover the wide row's features, and the kernel stores feature f's gradient also at the wide features
    block_features[l, f] >= 0 (l >= 1), each divided first by divisors[b, f] (a mean-pooled feature's bag size,
    else 1): the row blocks' sum's backward, on the way."""

    out_ptrs: torch.Tensor  # int64 [world]
    out_row_base: torch.Tensor  # int64 [world]
    out_row_len: torch.Tensor  # int64 [world]
    block_dest: torch.Tensor  # int32 [blocks per feature, features]
    block_dst: torch.Tensor  # int32 [blocks per feature, features]
    ready_ptrs: torch.Tensor  # int64 [world]: every rank's ready flags
    ack: torch.Tensor  # int32 [world]: the owners' acks, in this rank's memory
    error: torch.Tensor  # the exchange's error word (peer_flags.PeerErrors)
    rank: int
    epoch: int
    num_programs: int
    spin_limit: int
    scale: float
    block_features: torch.Tensor | None = None  # int32 [most row blocks, features] (row blocks only)
    divisors: torch.Tensor | None = None  # fp32 [local batch, features] (mean-pooled row-wise features only)


def is_feature_view(x: torch.Tensor, data_ptr: int, shape: tuple[int, ...], row_stride: int) -> bool:
    """Whether x is a 2-D tensor [batch, F * D] (its address, shape and row stride) seen as [batch, F, D] (row-major
    features, rows contiguous): the shape in which a kernel making that tensor's gradient stores it in row blocks
    (GradientDestinations)."""
    return (x.dim() == 3 and x.data_ptr() == data_ptr and x.shape[0] == shape[0]
            and x.shape[1] * x.shape[2] == shape[1] and x.stride() == (row_stride, x.shape[2], 1))


@triton.jit(do_not_specialize=["epoch"])  # one compiled binary serves every step (kernels/launch.py)
def _push_columns_kernel(
    src_ptr, src_row_len, src_cols_ptr, dst_cols_ptr, dims_ptr,  # per feature (grouped by destination)
    dest_order_ptr, tile_starts_ptr, walk_starts_ptr, program_starts_ptr, row_begin_ptr, row_end_ptr,  # plan
    feature_begin_ptr,
    out_ptrs, out_row_base_ptr, out_row_len_ptr,  # per destination
    ready_ptrs, ack_ptr, error_ptr, rank, epoch, num_programs, spin_limit, scale,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    t, end, stride = program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD, WORLD_P2)
    k, group_start, group_end = 0, 0, tl.load(tile_starts_ptr + 1)
    known_dest, released = tl.full([], -1, tl.int32), tl.full([], 0, tl.int1)
    stored = tl.full([], 1, tl.int1)  # every tile this program was to store
    while t < end:  # `while`: the interpreter cannot range() over loaded values
        k, group_start, group_end = next_tile_group(t, k, group_start, group_end, tile_starts_ptr)
        dest, f, rows, row_mask, first_row = tile_coords(k, t - group_start, dest_order_ptr, row_begin_ptr,
                                                         row_end_ptr, feature_begin_ptr, BLOCK_R)
        dim = tl.load(dims_ptr + f)
        mask = row_mask[:, None] & (d < dim)[None, :]
        src = src_ptr + rows.to(tl.int64)[:, None] * src_row_len + tl.load(src_cols_ptr + f) + d[None, :]
        tile = tl.load(src, mask=mask)
        known_dest, released = released_once_per_dest(ack_ptr, dest, epoch, spin_limit, error_ptr, known_dest,
                                                      released)
        mask = mask & released
        stored = stored & released
        out = tl.load(out_ptrs + dest).to(tl.pointer_type(src_ptr.dtype.element_ty))
        out_rows = (tl.load(out_row_base_ptr + dest) + rows - first_row).to(tl.int64)
        dst = out + out_rows[:, None] * tl.load(out_row_len_ptr + dest) + tl.load(dst_cols_ptr + f) + d[None, :]
        tl.store(dst, tile * scale, mask=mask)
        t += stride
    if stored:  # no flag over tiles not stored (peer_flags: a consumer would read an older call's)
        signal_ready(ready_ptrs, rank * num_programs + pid, epoch, WORLD)


class PushColumnsLaunch:
    """Launches of the push over one tile plan: what stays the same from call to call is bound once; a call fills
    in the source, the destinations' pointer table and the epoch and, on GPUs, launches the compiled binary
    (kernels/launch.py). Each program raises flag `rank * num_programs + pid` of the epoch in every rank after
    its stores, once `ack[dest] >= epoch - 1`."""

    def __init__(self, src_row_len: int, src_cols: torch.Tensor, dst_cols: torch.Tensor, dims: torch.Tensor,
                 block_dim: int, plan: PeerTilePlan, out_row_base: torch.Tensor, out_row_len: torch.Tensor,
                 ready_ptrs: torch.Tensor, ack: torch.Tensor, error: torch.Tensor, rank: int, spin_limit: int,
                 block_rows: int = 16):
        world = plan.dest_order.numel()
        self._args = Arguments(
            _push_columns_kernel, ("src_ptr", "out_ptrs", "epoch", "scale"),
            src_row_len=src_row_len, src_cols_ptr=src_cols, dst_cols_ptr=dst_cols, dims_ptr=dims,
            dest_order_ptr=plan.dest_order, tile_starts_ptr=plan.tile_starts,
            walk_starts_ptr=plan.walk_starts, program_starts_ptr=plan.program_starts, row_begin_ptr=plan.row_begin,
            row_end_ptr=plan.row_end, feature_begin_ptr=plan.feature_begin, out_row_base_ptr=out_row_base,
            out_row_len_ptr=out_row_len, ready_ptrs=ready_ptrs, ack_ptr=ack, error_ptr=error, rank=rank,
            num_programs=plan.num_programs, spin_limit=spin_limit, WORLD=world,
            WORLD_P2=triton.next_power_of_2(world), BLOCK_R=block_rows, BLOCK_D=block_dim)
        self._grid = (plan.num_programs, 1, 1)
        self._launches = CompiledLaunches(_push_columns_kernel)

    def __call__(self, src: torch.Tensor, out_ptrs: torch.Tensor, epoch: int, scale: float = 1.0) -> None:
        """src: [rows, src_row_len] fp32, contiguous; out_ptrs: int64 [world], every destination's buffer; the
        pushed values are src's times `scale`."""
        self._launches(aligned(src), self._grid, self._args(src, out_ptrs, epoch, scale), {})


@triton.jit
def _push_columns_nvshmem_kernel(
    src_ptr, src_row_len, src_cols_ptr, dst_cols_ptr, dims_ptr,  # src: symmetric (the puts read it)
    dest_order_ptr, tile_starts_ptr, walk_starts_ptr, program_starts_ptr, row_begin_ptr, row_end_ptr,
    feature_begin_ptr,
    out_ptr, out_row_base_ptr, out_row_len_ptr,  # out: this rank's symmetric buffer (same offsets in every PE)
    ready_ptr, ack_ptr, error_ptr, rank, epoch, num_programs, spin_limit,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """nvshmem transport: the same walk as the p2p kernel; local tiles are stored, remote ones put row by row (a
    tile's rows are contiguous in the source, strided in the destination) at the destination PE's offsets."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    t, end, stride = program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD, WORLD_P2)
    k, group_start, group_end = 0, 0, tl.load(tile_starts_ptr + 1)
    known_dest, released = tl.full([], -1, tl.int32), tl.full([], 0, tl.int1)
    stored = tl.full([], 1, tl.int1)  # every tile this program was to store
    while t < end:
        k, group_start, group_end = next_tile_group(t, k, group_start, group_end, tile_starts_ptr)
        dest, f, rows, row_mask, first_row = tile_coords(k, t - group_start, dest_order_ptr, row_begin_ptr,
                                                         row_end_ptr, feature_begin_ptr, BLOCK_R)
        dim = tl.load(dims_ptr + f)
        known_dest, released = released_once_per_dest(ack_ptr, dest, epoch, spin_limit, error_ptr, known_dest,
                                                      released)
        stored = stored & released
        first = tl.min(tl.where(row_mask, rows, 2**62), axis=0)
        src = src_ptr + first.to(tl.int64) * src_row_len + tl.load(src_cols_ptr + f)
        out_row_len = tl.load(out_row_len_ptr + dest)
        out_row = (tl.load(out_row_base_ptr + dest) + first - first_row).to(tl.int64)
        dst = out_ptr + out_row * out_row_len + tl.load(dst_cols_ptr + f)
        if dest == rank:
            mask = row_mask[:, None] & (d < dim)[None, :] & released
            tile = tl.load(src + r[:, None] * src_row_len + d[None, :], mask=mask)
            tl.store(dst + r[:, None] * out_row_len + d[None, :], tile, mask=mask)
        else:
            put_rows(dst, out_row_len, src, src_row_len, dim * 4,
                     tl.where(released, tl.sum(row_mask.to(tl.int32), axis=0), 0), dest)
        t += stride
    if stored:  # no flag over tiles not stored (peer_flags: a consumer would read an older call's)
        signal_ready_nvshmem(ready_ptr, rank * num_programs + pid, epoch, rank, WORLD)


def launch_push_columns_nvshmem(src: torch.Tensor, src_cols: torch.Tensor, dst_cols: torch.Tensor,
                                dims: torch.Tensor, block_dim: int, plan: PeerTilePlan, out: torch.Tensor,
                                out_row_base: torch.Tensor, out_row_len: torch.Tensor, ready: torch.Tensor,
                                ack: torch.Tensor, error: torch.Tensor, rank: int, epoch: int, spin_limit: int,
                                block_rows: int = 16) -> None:
    """The nvshmem transport's launch: `src` (fp32 [rows, src_row_len], symmetric), `out` (this rank's half of
    the symmetric gradient buffer) and the int64 `ready` / `ack` words (symmetric)."""
    world = plan.dest_order.numel()
    nvshmem_kernel(_push_columns_nvshmem_kernel)[(plan.num_programs,)](
        src, src.shape[1], src_cols, dst_cols, dims,
        plan.dest_order, plan.tile_starts, plan.walk_starts, plan.program_starts, plan.row_begin, plan.row_end,
        plan.feature_begin,
        out, out_row_base, out_row_len, ready, ack, error, rank, epoch, plan.num_programs, spin_limit,
        WORLD=world, WORLD_P2=triton.next_power_of_2(world), BLOCK_R=block_rows, BLOCK_D=block_dim)
