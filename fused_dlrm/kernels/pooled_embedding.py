"""Pooled embedding lookup whose output tiles are stored straight into their destination rank's buffer.

For the features one rank owns and every sample of the global batch, pool the rows each bag names (sum or mean,
optional per-sample weights; fp32 / fp16 / bf16 tables, fp32 accumulation) and store the [rows, dim] tile at its
final place: row (sample - first sample of its rank), columns [col, col + dim) of the destination's output.
With flags (the fused all-to-all) each program raises its ready flag in every rank after its stores; without
(the bulk path's lookup on GPU) every destination is this rank's own [global batch, owned dims] buffer.
Two transports: p2p stores through peer pointers (NVLink); nvshmem stores local tiles and puts remote ones row by
row at the same symmetric offsets of the destination PE (nvshmem_puts.py), which also crosses nodes.

`pooled_embedding_reference` is the pure-torch definition; the kernel must agree with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fused_dlrm.kernels import TL_DTYPES
from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, aligned
from fused_dlrm.kernels.nvshmem_puts import nvshmem_kernel, put_rows, signal_ready_nvshmem
from fused_dlrm.kernels.peer_flags import released_once_per_dest, signal_ready
from fused_dlrm.kernels.peer_tiles import PeerTilePlan, next_tile_group, program_walk, tile_coords


def pooled_embedding_reference(weight: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                               per_sample_weights: torch.Tensor | None, mean: bool) -> torch.Tensor:
    """[num_bags, dim] fp32 sums (or means; 0 for an empty bag) of the rows `values` names, bag b holding the
    next lengths[b] values."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    psw = None if per_sample_weights is None else per_sample_weights.float()
    if weight.dtype != torch.float32:  # pool in fp32: gather the rows first rather than converting the table
        weight, values = weight[values].float(), torch.arange(values.numel(), device=values.device)
    pooled = F.embedding_bag(values, weight, offsets, mode="sum", include_last_offset=True,
                             per_sample_weights=psw)
    if mean:
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    return pooled


@triton.jit
def _pool_tile(k, u, values_ptr, offsets_ptr, weights_ptr, table_ptrs, dims_ptr, mean_ptr,
               dest_order_ptr, row_begin_ptr, row_end_ptr, feature_begin_ptr, global_batch,
               BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr,
               HAS_WEIGHTS: tl.constexpr):
    """Tile u of the plan's group k: (destination, feature, its rows, row mask, the destination's first row, dim,
    the pooled [BLOCK_B, BLOCK_D] fp32 values)."""
    d = tl.arange(0, BLOCK_D)
    dest, f, rows, row_mask, first_row = tile_coords(k, u, dest_order_ptr, row_begin_ptr, row_end_ptr,
                                                     feature_begin_ptr, BLOCK_B)
    bag = f.to(tl.int64) * global_batch + rows
    start = tl.load(offsets_ptr + bag, mask=row_mask, other=0)
    length = tl.load(offsets_ptr + bag + 1, mask=row_mask, other=0) - start
    dim = tl.load(dims_ptr + f)
    d_mask = d < dim
    table = tl.load(table_ptrs + f).to(tl.pointer_type(TABLE_DTYPE))
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    longest = tl.max(length, axis=0)
    # BLOCK_L positions of every bag at once: BLOCK_B * BLOCK_L independent row gathers in flight.
    lanes = tl.arange(0, BLOCK_L)
    j = 0
    while j < longest:  # `while`: the interpreter cannot range() over loaded values
        pos = j + lanes
        m = row_mask[:, None] & (pos[None, :] < length[:, None])
        at = start[:, None] + pos[None, :]
        idx = tl.load(values_ptr + at, mask=m, other=0).to(tl.int64)  # index x dim passes 2**31 in big tables
        gathered = tl.load(table + idx[:, :, None] * dim + d[None, None, :],
                           mask=m[:, :, None] & d_mask[None, None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:  # in fp32, as the reference's (fp64 weights would make the fp32 sum fp64: no compile)
            gathered = gathered * tl.load(weights_ptr + at, mask=m, other=0.0).to(tl.float32)[:, :, None]
        acc += tl.sum(gathered, axis=1)
        j += BLOCK_L
    is_mean = tl.load(mean_ptr + f) != 0
    acc = tl.where(is_mean, acc / tl.maximum(length, 1).to(tl.float32)[:, None], acc)
    return dest, f, rows, row_mask, first_row, dim, acc


@triton.jit(do_not_specialize=["epoch"])  # one compiled binary serves every step (kernels/launch.py)
def _pooled_embedding_kernel(
    values_ptr, offsets_ptr, weights_ptr,  # bags, CSR over (owned feature, global sample)
    table_ptrs, dims_ptr, cols_ptr, mean_ptr,  # per owned feature: table address, dim, output column, is-mean
    dest_order_ptr, tile_starts_ptr, walk_starts_ptr, program_starts_ptr, row_begin_ptr, row_end_ptr,
    feature_begin_ptr,  # plan
    out_ptrs, out_row_base_ptr, out_row_len,  # per destination: output address, its row of the plan's first
    ready_ptrs, ack_ptr, error_ptr,
    rank, epoch, global_batch, num_programs, spin_limit,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SIGNAL: tl.constexpr,
):
    """p2p transport (and the bulk path's lookup): every tile stored through a pointer into its destination."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    # The tiles of one destination (peer_tiles.py); `while` loops: the interpreter cannot range() over loads.
    t, end, stride = program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD, WORLD_P2)
    k, group_start, group_end = 0, 0, tl.load(tile_starts_ptr + 1)
    known_dest, released = tl.full([], -1, tl.int32), tl.full([], 0, tl.int1)
    stored = tl.full([], 1, tl.int1)  # every tile this program was to store
    while t < end:
        k, group_start, group_end = next_tile_group(t, k, group_start, group_end, tile_starts_ptr)
        dest, f, rows, row_mask, first_row, dim, acc = _pool_tile(
            k, t - group_start, values_ptr, offsets_ptr, weights_ptr, table_ptrs, dims_ptr, mean_ptr,
            dest_order_ptr, row_begin_ptr, row_end_ptr, feature_begin_ptr, global_batch,
            BLOCK_B, BLOCK_L, BLOCK_D, TABLE_DTYPE, HAS_WEIGHTS)
        store_mask = row_mask[:, None] & (d < dim)[None, :]
        if SIGNAL:
            known_dest, released = released_once_per_dest(ack_ptr, dest, epoch, spin_limit, error_ptr,
                                                          known_dest, released)
            store_mask = store_mask & released
            stored = stored & released
        out = tl.load(out_ptrs + dest).to(tl.pointer_type(tl.float32))
        out_rows = (tl.load(out_row_base_ptr + dest) + rows - first_row).to(tl.int64)
        col = tl.load(cols_ptr + f)
        tl.store(out + out_rows[:, None] * out_row_len + col + d[None, :], acc, mask=store_mask)
        t += stride
    if SIGNAL:
        if stored:  # no flag over tiles not stored (peer_flags: a consumer would read an older call's)
            signal_ready(ready_ptrs, rank * num_programs + pid, epoch, WORLD)


@triton.jit
def _pooled_embedding_nvshmem_kernel(
    values_ptr, offsets_ptr, weights_ptr, table_ptrs, dims_ptr, cols_ptr, mean_ptr,
    dest_order_ptr, tile_starts_ptr, walk_starts_ptr, program_starts_ptr, row_begin_ptr, row_end_ptr,
    feature_begin_ptr,
    out_ptr, out_row_len, scratch_ptr,  # this rank's symmetric output (same offsets in every rank); put staging
    ready_ptr, ack_ptr, error_ptr,
    rank, epoch, global_batch, num_programs, spin_limit,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
):
    """nvshmem transport: local tiles are stored, remote ones staged and put row by row (a tile's rows are
    strided in the destination) to the destination PE at the same symmetric offsets."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    b = tl.arange(0, BLOCK_B)
    scratch = scratch_ptr + pid.to(tl.int64) * BLOCK_B * BLOCK_D
    t, end, stride = program_walk(pid, walk_starts_ptr, program_starts_ptr, WORLD, WORLD_P2)
    k, group_start, group_end = 0, 0, tl.load(tile_starts_ptr + 1)
    known_dest, released = tl.full([], -1, tl.int32), tl.full([], 0, tl.int1)
    stored = tl.full([], 1, tl.int1)  # every tile this program was to store
    while t < end:
        k, group_start, group_end = next_tile_group(t, k, group_start, group_end, tile_starts_ptr)
        dest, f, rows, row_mask, first_row, dim, acc = _pool_tile(
            k, t - group_start, values_ptr, offsets_ptr, weights_ptr, table_ptrs, dims_ptr, mean_ptr,
            dest_order_ptr, row_begin_ptr, row_end_ptr, feature_begin_ptr, global_batch,
            BLOCK_B, BLOCK_L, BLOCK_D, TABLE_DTYPE, HAS_WEIGHTS)
        known_dest, released = released_once_per_dest(ack_ptr, dest, epoch, spin_limit, error_ptr,
                                                      known_dest, released)
        stored = stored & released
        first_out_row = tl.min(tl.where(row_mask, rows, 2**62), axis=0) - first_row
        dst = out_ptr + first_out_row * out_row_len + tl.load(cols_ptr + f)
        if dest == rank:
            tl.store(dst + b[:, None] * out_row_len + d[None, :], acc,
                     mask=row_mask[:, None] & (d < dim)[None, :] & released)
        else:
            tl.store(scratch + b[:, None] * BLOCK_D + d[None, :], acc)
            put_rows(dst, out_row_len, scratch, BLOCK_D, dim * 4,
                     tl.where(released, tl.sum(row_mask.to(tl.int32), axis=0), 0), dest)
        t += stride
    if stored:  # no flag over tiles not stored (peer_flags: a consumer would read an older call's)
        signal_ready_nvshmem(ready_ptr, rank * num_programs + pid, epoch, rank, WORLD)


class PooledEmbeddingLaunch:
    """Launches of the p2p kernel over one tile plan: the fused exchange's (with flags: each program raises flag
    `rank * num_programs + pid` of the call's epoch in every rank after its stores, once `ack[dest] >= epoch - 1`)
    or the bulk path's lookup (no flags, one destination). What stays the same from call to call is bound once;
    a call fills in the bags, the output's pointer table and the epoch and, on GPUs, launches the compiled
    binary (kernels/launch.py): the host time of a call is a fraction of Triton's argument binding."""

    PER_CALL = ("values_ptr", "offsets_ptr", "weights_ptr", "out_ptrs", "epoch", "HAS_WEIGHTS")

    def __init__(self, features: "FeatureTable", plan: PeerTilePlan, global_batch: int, out_row_base: torch.Tensor,
                 out_row_len: int, rank: int = 0, ready_ptrs: torch.Tensor | None = None,
                 ack: torch.Tensor | None = None, error: torch.Tensor | None = None, spin_limit: int = 0):
        world = plan.dest_order.numel()
        signal = ready_ptrs is not None
        dummy = plan.dest_order  # stands in for pointers a specialisation never reads
        self._args = Arguments(
            _pooled_embedding_kernel, self.PER_CALL,
            table_ptrs=features.table_ptrs, dims_ptr=features.dims, cols_ptr=features.cols, mean_ptr=features.mean,
            dest_order_ptr=plan.dest_order, tile_starts_ptr=plan.tile_starts,
            walk_starts_ptr=plan.walk_starts, program_starts_ptr=plan.program_starts, row_begin_ptr=plan.row_begin,
            row_end_ptr=plan.row_end, feature_begin_ptr=plan.feature_begin, out_row_base_ptr=out_row_base,
            out_row_len=out_row_len, ready_ptrs=ready_ptrs if signal else dummy, ack_ptr=ack if signal else dummy,
            error_ptr=error if signal else dummy, rank=rank, global_batch=global_batch,
            num_programs=plan.num_programs, spin_limit=spin_limit, WORLD=world, WORLD_P2=triton.next_power_of_2(world),
            BLOCK_B=features.block_rows, BLOCK_L=features.block_len, BLOCK_D=features.block_dim,
            TABLE_DTYPE=TL_DTYPES[features.dtype], SIGNAL=signal)
        self._grid = (plan.num_programs, 1, 1)
        self._options = dict(num_warps=features.num_warps)
        self._launches = CompiledLaunches(_pooled_embedding_kernel)

    def __call__(self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                 out_ptrs: torch.Tensor, epoch: int = 0) -> None:
        """Enqueue one launch. out_ptrs: int64 [world], the output address of every destination (16-byte
        aligned, as all the tables a caller passes: they are fixed by the binary's specialisation)."""
        # The binary's specialisation follows the bags' dtypes and alignment and whether they carry weights.
        weights_key = None if weights is None else (weights.dtype, aligned(weights))
        key = (values.dtype, aligned(values), aligned(offsets), weights_key)
        has_weights = weights is not None
        args = self._args(values, offsets, weights if has_weights else offsets, out_ptrs, epoch, has_weights)
        self._launches(key, self._grid, args, self._options)


def launch_pooled_embedding_nvshmem(values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                                    features: "FeatureTable", plan: PeerTilePlan, global_batch: int,
                                    out: torch.Tensor, out_row_len: int, scratch: torch.Tensor, rank: int, epoch: int, ready: torch.Tensor, ack: torch.Tensor,
                                    error: torch.Tensor, spin_limit: int) -> None:
    """The nvshmem transport's launch: `out` (this rank's half of the symmetric output), `scratch`
    ([plan.num_programs * block_rows * block_dim] fp32) and the int64 `ready` / `ack` words are symmetric."""
    world = plan.dest_order.numel()
    nvshmem_kernel(_pooled_embedding_nvshmem_kernel)[(plan.num_programs,)](
        values, offsets, weights if weights is not None else offsets,
        features.table_ptrs, features.dims, features.cols, features.mean,
        plan.dest_order, plan.tile_starts, plan.walk_starts, plan.program_starts, plan.row_begin, plan.row_end,
        plan.feature_begin,
        out, out_row_len, scratch, ready, ack, error,
        rank, epoch, global_batch, plan.num_programs, spin_limit,
        WORLD=world, WORLD_P2=triton.next_power_of_2(world), BLOCK_B=features.block_rows,
        BLOCK_L=features.block_len, BLOCK_D=features.block_dim, TABLE_DTYPE=TL_DTYPES[features.dtype],
        HAS_WEIGHTS=weights is not None, num_warps=features.num_warps)


def common_table_dtype(weights: list[torch.Tensor]) -> torch.dtype:
    """The one dtype of the tables a launch reads (fp32, fp16 or bf16)."""
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise ValueError(f"one launch handles tables of one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.float32
    if dtype not in TL_DTYPES:
        raise ValueError(f"table dtype {dtype} is not supported (fp32, fp16, bf16)")
    return dtype


class FeatureTable:
    """Per-feature metadata of one launch, built once: table addresses, dims, output columns, pooling."""

    def __init__(self, weights: list[torch.Tensor], cols: list[int], mean: list[bool], device: torch.device,
                 block_rows: int | None = None, block_len: int = 4, num_warps: int = 1):
        """Tiles of block_rows bags x block_len positions x all dims; by default about 1k elements per step and
        one warp (the best of a sweep on H200, docs/benchmarks.md: small tiles, many programs, many gathers in
        flight; prefetching the next indices did not help)."""
        self.dtype = common_table_dtype(weights)
        self.weights = weights  # keeps the tables (whose addresses the kernel reads) alive
        self.table_ptrs = torch.tensor([w.data_ptr() for w in weights] or [0], dtype=torch.int64, device=device)
        self.dims = torch.tensor([w.shape[1] for w in weights] or [0], dtype=torch.int32, device=device)
        self.cols = torch.tensor(cols or [0], dtype=torch.int64, device=device)
        self.mean = torch.tensor(mean or [False], dtype=torch.int32, device=device)
        self.block_dim = triton.next_power_of_2(max([w.shape[1] for w in weights] or [1]))
        self.block_len = block_len
        self.block_rows = block_rows or max(1, 1024 // (block_len * self.block_dim))
        self.num_warps = num_warps
