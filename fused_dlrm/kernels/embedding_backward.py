"""Backward of the pooled lookup fused with the exact embedding optimizer, for all owned tables at once.

Like fbgemm's TBE backward: every occurrence (value) of the bags gets a sort key (table << row_bits | row: 32-bit
when it fits, so the radix sort makes half the passes); sorting the keys groups all occurrences of one row of one
table, across bags and across the features that share the table.
One program per group (segment) sums the occurrences' gradients in fp32 and applies the update to its row in
place, so no per-occurrence [N, dim] gradient is materialised and each touched row is read and written once:
  SGD:                 w -= lr * g
  row-wise Adagrad:    m[row] += mean(g^2 over the row);  w -= lr * g / (sqrt(m[row]) + eps)
The gradient of an occurrence of bag (feature f, sample b) is grad[b, col_f : col_f + dim] times its scale
(per-sample weight if weighted, times 1 / max(bag length, 1) if f is mean-pooled).

Each table has its own optimizer (torchrec's per-table settings): the program reads its row's table's lr and eps
from a small device tensor ([tables, 2] fp32) and, where some table is row-wise Adagrad, whether this one is (a
table with momentum is). So the launches below update every table, whatever their optimizers, and the settings
change without a host sync (a changed lr is one pinned, non-blocking copy of that tensor: `optimizer_settings`).
torchrec's other way, one lookup per group of tables of equal settings (fbgemm's TBE takes one optimizer), would
launch the backward (and the plan, and the forward) once per group.

Two steps, no host sync: `plan_embedding_backward` needs only the bags (one kernel writes every occurrence's key,
gradient offset and scale; a sort; the segments, two kernels of kernels/sorted_segments.py, whose count stays on
the device); then two kernels of persistent programs (a fixed grid each) walk the segments with the gradient,
every segment in exactly one of them by its length:
  _embedding_backward_kernel   segments of at most HOT_THRESHOLD occurrences (nearly every row): a narrow tile of
                               few registers, many programs, one segment per step;
  _hot_segments_kernel         the longer ones (the hot rows of skewed, Zipf-like data, over half of all
                               occurrences): a wide tile, so that a row of 4k occurrences is ~65 steps of one
                               program instead of ~2k, which were the first kernel's critical path.
Neither builds a list of the hot segments: the first skips them from the start and end it loads anyway, the
second finds them in the segment starts. (Running the plan during the forward on a side stream was tried on
2 x H200: no gain in the benchmark, a lower whole-step ratio; docs/benchmarks.md.)
`embedding_backward_reference` is the pure-torch definition (the per-table path the CPU runs); the kernels must
agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from fused_dlrm.dist.host_copy import host_to_device
from fused_dlrm.kernels.launch import CompiledLaunches, aligned, resident_programs_per_sm
from fused_dlrm.kernels import TL_DTYPES
from fused_dlrm.kernels.pooled_embedding import common_table_dtype
from fused_dlrm.kernels.sorted_segments import sorted_segments

if TYPE_CHECKING:  # only annotations: importing fused_dlrm.sparse here would be circular (lookup.py imports us)
    from fused_dlrm.sparse.input_dist import OwnedBags
    from fused_dlrm.sparse.optimizer import EmbeddingOptimizer, EmbeddingOptimizerConfig


# A segment's occurrences are gathered TILE_ELEMENTS // BLOCK_D at a time (at least 1): a hot row's gradient rows
# load in parallel, while a row seen once (most rows) wastes few masked lanes.
# Segments of more than HOT_THRESHOLD occurrences go to the hot-segment kernel, which gathers HOT_TILE_ELEMENTS //
# BLOCK_D occurrences at a time (64 at dim 256) over HOT_NUM_WARPS warps. 32 occurrences are 16 steps of the narrow
# kernel at dim 256, half a step of the wide one: shorter segments would leave most of the wide tile's lanes masked,
# longer ones hold the narrow kernel's programs on them (under Zipf(1.05), rows of more than 32 occurrences hold
# over half of all occurrences; a table's hottest row ~10% of the table's). The threshold is a kernel argument,
# not a constexpr.
# Swept on an H200 (docs/benchmarks.md, 2026-11-24: 64 tables x 100k rows, batch 4096, pooling ~10, row-wise
# Adagrad, dims 256 / 128 / 64, Zipf(1.05) and uniform rows): one warp for the narrow kernel (was 2) and 16384
# elements over 4 warps for the hot one (was 8192 over 8) took the whole backward from 1.80 / 1.94 / 1.18 ms to
# 1.61 / 1.13 / 1.03 (Zipf) and from 2.05 / 1.96 / 2.15 to 1.84 / 1.44 / 1.34 (uniform).
TILE_ELEMENTS = 512
NUM_WARPS = 1
HOT_THRESHOLD = 32
HOT_TILE_ELEMENTS = 16384
HOT_NUM_WARPS = 4
# The hot kernel reads the lengths of HOT_SCAN_SEGMENTS segments at once: 4 a thread over 4 warps (more cost it
# registers over the update).
HOT_SCAN_SEGMENTS = 512
KEY_DTYPES = {torch.int32: tl.int32, torch.int64: tl.int64}  # sort keys
# The occurrence kernel takes OCCURRENCE_BAGS bags per program, OCCURRENCE_POSITIONS of their positions at a time
# (not tuned: it moves ~20 bytes per occurrence, a few percent of the update kernel's traffic).
OCCURRENCE_BAGS = 16
OCCURRENCE_POSITIONS = 8


def pooled_lookup_row_grads(grad: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                            per_sample_weights: torch.Tensor | None, mean: bool) -> torch.Tensor:
    """Gradient of each occurrence in `values` ([N, dim]) given the gradient of the pooled bags ([num_bags, dim])."""
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths,
                                  output_size=values.numel())
    row_grads = grad[bag]
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights.to(grad.dtype)
    if mean:
        inv_len = 1.0 / lengths.clamp(min=1).to(grad.dtype)[bag]
        scale = inv_len if scale is None else scale * inv_len
    return row_grads if scale is None else row_grads * scale.unsqueeze(1)


def embedding_backward_reference(bags: OwnedBags, grad: torch.Tensor, optimizer: EmbeddingOptimizer,
                                 features: list[tuple[str, bool]]) -> None:
    """Update the tables in place from the gradient of the pooled output `grad` [global batch, owned dims]:
    per table, the occurrences' gradients of all its features go to `optimizer.step`.
    features[i] = (table, mean-pooled) of the i-th owned feature, in output column order."""

    grad_columns = torch.split(grad, [optimizer.weights[t].shape[1] for t, _ in features], dim=1)
    rows: dict[str, list[torch.Tensor]] = {}
    row_grads: dict[str, list[torch.Tensor]] = {}
    for i, (table, mean) in enumerate(features):
        values, lengths, weights = bags.feature_bags(i)
        rows.setdefault(table, []).append(values)
        row_grads.setdefault(table, []).append(pooled_lookup_row_grads(grad_columns[i], values, lengths, weights,
                                                                       mean))
    for table in rows:
        optimizer.step(table, torch.cat(rows[table]), torch.cat(row_grads[table]))


# The ints are not specialised: one compiled binary serves every batch and every lookup's tables (kernels/launch.py;
# the binaries are shared by all lookups of a process, and their keys hold no ints).
@triton.jit(do_not_specialize=["num_bags", "batch", "row_len", "row_bits"])
def _occurrences_kernel(
    values_ptr, csr_ptr, weights_ptr,  # the bags: CSR over (owned feature, global sample), feature-major
    feature_table_ptr, cols_ptr, mean_ptr,  # per owned feature: its table, first gradient column, mean-pooled
    keys_ptr, grad_offsets_ptr, scales_ptr,  # out, per occurrence: sort key, where its gradient starts, its scale
    num_bags, batch, row_len, row_bits,
    BLOCK_BAGS: tl.constexpr, BLOCK_L: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_SCALE: tl.constexpr,
    KEY_DTYPE: tl.constexpr,
):
    """Every occurrence of BLOCK_BAGS bags, BLOCK_L positions at a time: what the backward needs of it before the
    sort (one kernel for what would be a dozen elementwise torch ops, each a launch of host time)."""
    bag = tl.program_id(0) * BLOCK_BAGS + tl.arange(0, BLOCK_BAGS)
    bag_mask = bag < num_bags
    start = tl.load(csr_ptr + bag, mask=bag_mask, other=0)
    length = tl.load(csr_ptr + bag + 1, mask=bag_mask, other=0) - start
    feature = bag // batch
    table = tl.load(feature_table_ptr + feature, mask=bag_mask, other=0)
    sample = (bag - feature * batch).to(tl.int64)  # sample * row_len may pass 2**31 (batch x all dims)
    grad_offset = sample * row_len + tl.load(cols_ptr + feature, mask=bag_mask, other=0)
    # IEEE division (`/` is approximate on GPUs), as the torch reference computes 1 / length.
    inv_len = tl.div_rn(1.0, tl.maximum(length, 1).to(tl.float32))
    scale = tl.where(tl.load(mean_ptr + feature, mask=bag_mask, other=0) != 0, inv_len, 1.0)
    lanes = tl.arange(0, BLOCK_L)
    longest = tl.max(length, axis=0)
    j = 0
    while j < longest:  # `while`: the interpreter cannot range() over loaded values
        pos = j + lanes
        m = bag_mask[:, None] & (pos[None, :] < length[:, None])
        occ = start[:, None] + pos[None, :]
        row = tl.load(values_ptr + occ, mask=m, other=0).to(tl.int64)
        tl.store(keys_ptr + occ, ((table[:, None] << row_bits) | row).to(KEY_DTYPE), mask=m)
        tl.store(grad_offsets_ptr + occ, grad_offset[:, None] + tl.zeros_like(occ), mask=m)
        if HAS_SCALE:
            occ_scale = scale[:, None] + tl.zeros([BLOCK_BAGS, BLOCK_L], tl.float32)
            if HAS_WEIGHTS:
                occ_scale = tl.load(weights_ptr + occ, mask=m, other=0.0).to(tl.float32) * occ_scale
            tl.store(scales_ptr + occ, occ_scale, mask=m)
        j += BLOCK_L


# Which tables are row-wise Adagrad's (the backward kernels' ADAGRAD; the others are SGD's).
NO_ADAGRAD, SOME_ADAGRAD, ALL_ADAGRAD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _update_row(j, end, key, row_bits, grad_ptr, grad_offsets_ptr, scales_ptr, table_ptrs, momentum_ptrs, dims_ptr,
                adagrad_ptr, settings_ptr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr,
                HAS_SCALE: tl.constexpr, ADAGRAD: tl.constexpr, WIDE: tl.constexpr):
    """Sum the gradients of the occurrences j .. end - 1 (one segment) in fp32, BLOCK_N at a time, and apply the
    optimizer of their table to their row (key = t << row_bits | row). ADAGRAD: which tables are row-wise Adagrad's
    (`adagrad_tables`): none (every table SGD), every one, or some (a row's table's kind is read, its momentum read
    and written masked off where the table is SGD's: a dependent load per row that uniform collections skip). WIDE (the
    hot-segment kernel's tile): sum [BLOCK_N, BLOCK_D] tiles and reduce over the occurrences once at the end (no
    cross-warp reduction per step), and load the next step's offsets and scales before this step's gradients are
    used (one memory latency per step, not two)."""
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    t = key >> row_bits
    row = key - (t << row_bits)
    dim = tl.load(dims_ptr + t)
    d_mask = d < dim
    lr = tl.load(settings_ptr + 2 * t)
    # The row is this program's alone (keys are unique per segment, and a segment is either kernel's, never both):
    # plain read-modify-write, no atomics. Its loads are issued before the gradients' so that their latencies
    # overlap.
    table = tl.load(table_ptrs + t).to(tl.pointer_type(TABLE_DTYPE))
    w_ptrs = table + row * dim + d
    w = tl.load(w_ptrs, mask=d_mask, other=0.0).to(tl.float32)
    if ADAGRAD != NO_ADAGRAD:
        if ADAGRAD == ALL_ADAGRAD:
            adagrad = tl.full([], 1, tl.int1)
        else:
            adagrad = tl.load(adagrad_ptr + t) != 0  # else SGD, whose momentum address (0) the masks keep unread
        eps = tl.load(settings_ptr + 2 * t + 1)
        momentum = tl.load(momentum_ptrs + t).to(tl.pointer_type(tl.float32)) + row
        m_row = tl.load(momentum, mask=adagrad, other=0.0)

    # Columns past the table's dim load as 0 and stay 0.
    if WIDE:
        tile = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        m = j + n < end
        offset = tl.load(grad_offsets_ptr + j + n, mask=m, other=0)
        if HAS_SCALE:
            scale = tl.load(scales_ptr + j + n, mask=m, other=0.0)
        while j < end:
            g = tl.load(grad_ptr + offset[:, None] + d[None, :], mask=m[:, None] & d_mask[None, :], other=0.0)
            if HAS_SCALE:
                g_scale = scale
            j += BLOCK_N
            m = j + n < end
            offset = tl.load(grad_offsets_ptr + j + n, mask=m, other=0)
            if HAS_SCALE:
                scale = tl.load(scales_ptr + j + n, mask=m, other=0.0)
                g = g * g_scale[:, None]
            tile += g
        acc = tl.sum(tile, axis=0)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        while j < end:
            occ = j + n
            m = occ < end
            offset = tl.load(grad_offsets_ptr + occ, mask=m, other=0)
            g = tl.load(grad_ptr + offset[:, None] + d[None, :], mask=m[:, None] & d_mask[None, :], other=0.0)
            if HAS_SCALE:
                g = g * tl.load(scales_ptr + occ, mask=m, other=0.0)[:, None]
            acc += tl.sum(g, axis=0)
            j += BLOCK_N

    if ADAGRAD != NO_ADAGRAD:
        m_row = m_row + tl.div_rn(tl.sum(acc * acc, axis=0), dim.to(tl.float32))
        tl.store(momentum, m_row, mask=adagrad)
        # IEEE sqrt and division (tl.sqrt and `/` are approximate on GPUs), as the torch path computes them.
        w = w - acc * tl.where(adagrad, tl.div_rn(lr, tl.sqrt_rn(m_row) + eps), lr)
    else:
        w = w - lr * acc
    tl.store(w_ptrs, w.to(TABLE_DTYPE), mask=d_mask)


@triton.jit(do_not_specialize=["num_values", "row_bits", "hot_threshold"])  # as above
def _embedding_backward_kernel(
    starts_ptr, keys_ptr, num_segments_ptr, num_values, row_bits,  # sorted_segments(): first index, key
    grad_ptr, grad_offsets_ptr, scales_ptr,  # per occurrence, in key order: where its gradient starts, its scale
    table_ptrs, momentum_ptrs, dims_ptr,  # per table: weight address, momentum address, dim
    adagrad_ptr, settings_ptr,  # per table: row-wise Adagrad or SGD; (lr, eps)
    hot_threshold,  # segments of more occurrences are _hot_segments_kernel's
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr,
    ADAGRAD: tl.constexpr,
):
    # Persistent: the grid does not depend on the segment count (on the device only), so the programs stride over
    # the segments (`while`: the interpreter cannot range() over loaded values).
    num_segments = tl.load(num_segments_ptr)
    seg = tl.program_id(0)
    while seg < num_segments:
        j = tl.load(starts_ptr + seg)
        end = tl.load(starts_ptr + seg + 1, mask=seg + 1 < num_segments, other=num_values)  # last: to the end
        key = tl.load(keys_ptr + seg).to(tl.int64)  # beside start and end, not after the test: latencies overlap
        if end - j <= hot_threshold:
            _update_row(j, end, key, row_bits, grad_ptr, grad_offsets_ptr, scales_ptr, table_ptrs, momentum_ptrs,
                        dims_ptr, adagrad_ptr, settings_ptr, BLOCK_N, BLOCK_D, TABLE_DTYPE, HAS_SCALE, ADAGRAD,
                        False)
        seg += tl.num_programs(0)


@triton.jit
def _first_hot_segment(starts_ptr, first, last, num_segments, num_values, hot_threshold, BLOCK_SCAN: tl.constexpr):
    """The first of the segments first .. last - 1 (last - first <= BLOCK_SCAN) with more than hot_threshold
    occurrences, or last."""
    seg = first + tl.arange(0, BLOCK_SCAN)
    start = tl.load(starts_ptr + seg, mask=seg < last, other=0)
    end = tl.load(starts_ptr + seg + 1, mask=seg + 1 < num_segments, other=num_values)
    return tl.min(tl.where((seg < last) & (end - start > hot_threshold), seg, last), axis=0)


@triton.jit(do_not_specialize=["num_values", "row_bits", "hot_threshold"])  # as above
def _hot_segments_kernel(
    starts_ptr, keys_ptr, num_segments_ptr, num_values, row_bits,  # as _embedding_backward_kernel's
    grad_ptr, grad_offsets_ptr, scales_ptr,
    table_ptrs, momentum_ptrs, dims_ptr, adagrad_ptr, settings_ptr,
    hot_threshold,  # the segments of more occurrences than this are this kernel's
    BLOCK_SCAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr, ADAGRAD: tl.constexpr,
):
    # No list of the hot segments is built (an atomic append in the other kernel costs it registers; torch ops
    # cost a launch each): persistent programs stride over windows of BLOCK_SCAN segments, find the hot ones from
    # the starts (8 bytes a segment) and take them in turn. After each, the rest of the window is read again
    # (from L2) rather than kept in registers over the update.
    num_segments = tl.load(num_segments_ptr)
    first = tl.program_id(0) * BLOCK_SCAN
    while first < num_segments:
        last = tl.minimum(first + BLOCK_SCAN, num_segments)
        seg = _first_hot_segment(starts_ptr, first, last, num_segments, num_values, hot_threshold, BLOCK_SCAN)
        while seg < last:
            j = tl.load(starts_ptr + seg)
            end = tl.load(starts_ptr + seg + 1, mask=seg + 1 < num_segments, other=num_values)
            key = tl.load(keys_ptr + seg).to(tl.int64)
            _update_row(j, end, key, row_bits, grad_ptr, grad_offsets_ptr, scales_ptr, table_ptrs, momentum_ptrs,
                        dims_ptr, adagrad_ptr, settings_ptr, BLOCK_N, BLOCK_D, TABLE_DTYPE, HAS_SCALE, ADAGRAD,
                        True)
            seg = _first_hot_segment(starts_ptr, seg + 1, last, num_segments, num_values, hot_threshold, BLOCK_SCAN)
        first += BLOCK_SCAN * tl.num_programs(0)


class BackwardTables:
    """Metadata of one backward launch, built once: per table its address, momentum address, dim and optimizer; per
    owned feature (output column order) its table, first output column and pooling."""

    def __init__(self, weights: list[torch.Tensor], momentum: list[torch.Tensor | None], feature_tables: list[int],
                 mean: list[bool], device: torch.device):
        """momentum: each table's optimizer state, fp32 [rows] for row-wise Adagrad, None for SGD (which has none):
        that also says which optimizer updates the table."""
        self.dtype = common_table_dtype(weights)
        for w in weights:
            if w.shape[0] >= 2**31 or not w.is_contiguous():  # rows and tables share a 64-bit sort key at most
                raise ValueError(f"tables must be contiguous with < 2**31 rows, got {tuple(w.shape)}")
        if any(m is not None and (m.dtype != torch.float32 or m.shape != w.shape[:1])
               for m, w in zip(momentum, weights, strict=True)):
            raise ValueError("momentum must be fp32 [rows] per table")
        self.weights, self.momentum = weights, momentum  # keep alive the tensors whose addresses the kernel reads
        self.addresses = self._addresses(weights, momentum)
        dims = [w.shape[1] for w in weights]
        feature_dims = [dims[t] for t in feature_tables]

        def tensor(values, dtype):
            return torch.tensor(values or [0], dtype=dtype, device=device)

        self.table_ptrs = tensor([w.data_ptr() for w in weights], torch.int64)
        adagrad = [m is not None for m in momentum]
        self.adagrad = tensor(adagrad, torch.bool)
        self.adagrad_tables = (ALL_ADAGRAD if all(adagrad) else SOME_ADAGRAD if any(adagrad) else NO_ADAGRAD).value
        # An SGD table has no state: the kernel never reads its address.
        self.momentum_ptrs = tensor([0 if m is None else m.data_ptr() for m in momentum], torch.int64)
        self.dims = tensor(dims, torch.int32)
        self.feature_table = tensor(feature_tables, torch.int64)
        # Sort keys table << row_bits | row in 32 bits when they fit (a radix sort's passes follow the key width).
        self.row_bits = max(max((w.shape[0] - 1).bit_length() for w in weights) if weights else 1, 1)
        fits = self.row_bits + max(len(weights) - 1, 1).bit_length() <= 31
        self.key_dtype = torch.int32 if fits else torch.int64
        self.cols = tensor([sum(feature_dims[:i]) for i in range(len(feature_dims))], torch.int64)
        self.mean = tensor(mean, torch.bool)
        self.any_mean = any(mean)
        self.row_len = sum(feature_dims)  # width of the pooled output and of its gradient
        self.block_dim = triton.next_power_of_2(max(dims or [1]))

    @staticmethod
    def _addresses(weights, momentum) -> tuple[int, ...]:
        return tuple(map(_address, [*weights, *momentum]))  # checked per step: no genexpr

    def describes(self, weights: list[torch.Tensor], momentum: list[torch.Tensor | None]) -> bool:
        """Whether these are still the tensors it was built for (host-only check: no device work)."""
        return self._addresses(weights, momentum) == self.addresses


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def optimizer_settings(configs: list[EmbeddingOptimizerConfig], device: torch.device) -> torch.Tensor:
    """Each table's (lr, eps), [tables, 2] fp32, as the kernels read them: on GPUs one pinned, non-blocking copy
    (no host sync), made again whenever a setting changes."""
    settings = np.array([(c.lr, c.eps) for c in configs], dtype=np.float32).reshape(len(configs), 2)
    return host_to_device([settings], device)[0]


@dataclass
class BackwardPlan:
    """What the backward needs of one batch's bags, in key order (plan_embedding_backward)."""
    num_values: int
    starts: torch.Tensor  # sorted_segments(): each segment's first occurrence
    segment_keys: torch.Tensor  # and its key
    num_segments: torch.Tensor  # [1], on the device
    grad_offsets: torch.Tensor  # per occurrence: where its gradient starts in the pooled gradient
    scales: torch.Tensor | None  # per occurrence: per-sample weight x 1 / bag length (mean pooling), if any

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Made on another stream (a thread's, ahead), read on `stream`: keep the allocator off it until then."""
        for t in (self.starts, self.segment_keys, self.num_segments, self.grad_offsets, self.scales):
            if t is not None:
                t.record_stream(stream)


def plan_embedding_backward(bags: OwnedBags, tables: BackwardTables) -> BackwardPlan | None:
    """The bag-only half of the backward (None when the bags hold no occurrence): every occurrence's key, gradient
    offset and scale (one kernel), the stable sort by key (a segment sums in occurrence order), the segments."""
    values, n = bags.values, bags.values.numel()
    if n == 0:
        return None
    device = values.device
    has_scale = bags.weights is not None or tables.any_mean
    keys = torch.empty(n, dtype=tables.key_dtype, device=device)
    grad_offsets = torch.empty(n, dtype=torch.int64, device=device)
    scales = torch.empty(n, dtype=torch.float32, device=device) if has_scale else None
    csr = bags.csr_offsets()
    num_bags = bags.lengths.numel()
    args = (values, csr, bags.weights if bags.weights is not None else csr,  # stand-in, never read
            tables.feature_table, tables.cols, tables.mean, keys, grad_offsets, scales if has_scale else keys,
            num_bags, bags.global_batch, tables.row_len, tables.row_bits,
            OCCURRENCE_BAGS, OCCURRENCE_POSITIONS, bags.weights is not None, has_scale, KEY_DTYPES[tables.key_dtype])
    # The binary's specialisation: the constexprs, the bags' dtypes and alignment (other tensors are fresh).
    weights_key = None if bags.weights is None else (bags.weights.dtype, aligned(bags.weights))
    key = (values.dtype, aligned(values), aligned(csr), weights_key, has_scale, tables.key_dtype)
    _OCCURRENCE_LAUNCHES(key, (triton.cdiv(num_bags, OCCURRENCE_BAGS), 1, 1), args, dict(num_warps=4))
    keys, order = torch.sort(keys, stable=True)
    starts, segment_keys, num_segments = sorted_segments(keys)
    return BackwardPlan(n, starts, segment_keys, num_segments, grad_offsets[order],
                        None if scales is None else scales[order])


def launch_embedding_backward(bags: OwnedBags, grad: torch.Tensor, tables: BackwardTables, settings: torch.Tensor,
                              plan: BackwardPlan | None = None) -> None:
    """Update every owned table in place (and the row-wise Adagrad momentum in `tables.momentum`) from the
    gradient of the pooled output `grad` [global batch, owned dims], each table by its optimizer: `settings` is
    optimizer_settings of the tables' configs, the kind (SGD or row-wise Adagrad) the tables' (BackwardTables). No
    host sync. `plan`: these bags' plan_embedding_backward if made ahead (it needs only the bags), else made here."""
    if settings.shape != (len(tables.weights), 2) or settings.dtype != torch.float32:
        raise ValueError(f"optimizer settings of shape {tuple(settings.shape)} ({settings.dtype}), expected "
                         f"{(len(tables.weights), 2)} fp32: (lr, eps) per table")
    if grad.shape != (bags.global_batch, tables.row_len):
        raise ValueError(f"gradient of shape {tuple(grad.shape)}, expected {(bags.global_batch, tables.row_len)}")
    if plan is None:
        plan = plan_embedding_backward(bags, tables)
    if plan is None:  # no occurrence: no row to update
        return
    grad = grad.float().contiguous()
    n = plan.num_values
    has_scale = plan.scales is not None
    common = (plan.starts, plan.segment_keys, plan.num_segments, n, tables.row_bits,
              grad, plan.grad_offsets, plan.scales if has_scale else plan.grad_offsets,  # stand-in
              tables.table_ptrs, tables.momentum_ptrs, tables.dims, tables.adagrad, settings, HOT_THRESHOLD)
    adagrad = tables.adagrad_tables
    constexprs = (tables.block_dim, TL_DTYPES[tables.dtype], has_scale, adagrad)
    # What the binaries' specialisation follows from besides the constexprs: the keys' width and the alignment of
    # the tensors that are views (the gradient may be one into a symmetric buffer; the segment count is the last
    # element of a cumsum); the other tensors are fresh allocations or the tables' fixed metadata. The tiles and
    # warps come from module constants, which the tests and the benchmark change: in the keys too.
    key = (tables.dtype, tables.key_dtype, tables.block_dim, has_scale, adagrad, aligned(grad),
           aligned(plan.num_segments))
    block_n = max(1, TILE_ELEMENTS // tables.block_dim)
    _launch_persistent(_LAUNCHES, key + (block_n, NUM_WARPS), n, common + (block_n, *constexprs), NUM_WARPS,
                       grad.device)
    if n > HOT_THRESHOLD:  # else no segment is hot
        hot_block_n = max(1, HOT_TILE_ELEMENTS // tables.block_dim)
        _launch_persistent(_HOT_LAUNCHES, key + (HOT_SCAN_SEGMENTS, hot_block_n, HOT_NUM_WARPS),
                           triton.cdiv(n, HOT_SCAN_SEGMENTS),  # windows of segments, at most
                           common + (HOT_SCAN_SEGMENTS, hot_block_n, *constexprs), HOT_NUM_WARPS, grad.device)


def _launch_persistent(launches: CompiledLaunches, key: tuple, most: int, args: tuple, num_warps: int,
                       device: torch.device) -> None:
    """Launch a persistent kernel on at most `most` programs (it strides over its work by the grid size): as many
    as are resident at once (from the compiled binary's registers and shared memory), so they all run in one wave
    and each walks its share of the (mostly tiny) segments; a larger grid would leave a second wave of programs
    that start only when the first ones have walked all of theirs. The interpreter runs programs one by one: few."""
    options = dict(num_warps=num_warps)
    programs = min(most, 4)
    binary = launches.compiled(key, (programs, 1, 1), args, options)
    if binary is not None:
        per_sm = resident_programs_per_sm(binary.n_regs, num_warps, binary.metadata.shared)
        programs = min(most, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)
    launches(key, (programs, 1, 1), args, options)


_OCCURRENCE_LAUNCHES = CompiledLaunches(_occurrences_kernel)
_LAUNCHES = CompiledLaunches(_embedding_backward_kernel)
_HOT_LAUNCHES = CompiledLaunches(_hot_segments_kernel)
