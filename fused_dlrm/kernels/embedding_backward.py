"""Backward of the pooled lookup fused with the exact embedding optimizer, for all owned tables in one launch.

Like fbgemm's TBE backward: every occurrence (value) of the bags gets a sort key (table << 32 | row); sorting the
keys groups all occurrences of one row of one table, across bags and across the features that share the table.
One program per group (segment) sums the occurrences' gradients in fp32 and applies the update to its row in
place, so no per-occurrence [N, dim] gradient is materialised and each touched row is read and written once:
  SGD:                 w -= lr * g
  row-wise Adagrad:    m[row] += mean(g^2 over the row);  w -= lr * g / (sqrt(m[row]) + eps)
The gradient of an occurrence of bag (feature f, sample b) is grad[b, col_f : col_f + dim] times its scale
(per-sample weight if weighted, times 1 / max(bag length, 1) if f is mean-pooled).

Host side: a handful of torch ops and no host sync: the segment count stays on the device, and a fixed grid of
persistent programs walks the segments. `embedding_backward_reference` is the pure-torch definition (the
per-table path the CPU runs); the kernel must agree with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import CompiledLaunches, aligned, resident_programs_per_sm
from fused_dlrm.kernels.pooled_embedding import TL_DTYPES, common_table_dtype

if TYPE_CHECKING:  # only annotations: importing fused_dlrm.sparse here would be circular (lookup.py imports us)
    from fused_dlrm.sparse.input_dist import OwnedBags
    from fused_dlrm.sparse.optimizer import EmbeddingOptimizer, EmbeddingOptimizerConfig


# A segment's occurrences are gathered TILE_ELEMENTS // BLOCK_D at a time (at least 1): a hot row's gradient rows
# load in parallel, while a row seen once (most rows) wastes few masked lanes. 512 elements over 2 warps was the
# fastest on an H200 (64 tables of dim 256, 1.3M occurrences: 1.30 ms vs 1.93 ms for 2048 over 4 warps; dim 64
# with skewed rows agreed).
TILE_ELEMENTS = 512
NUM_WARPS = 2


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


def segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments (runs of equal values) of the sorted `keys` [n > 0], without a host sync: `starts` and
    `segment_keys` [n + 1], whose first `num_segments` entries are each segment's first index and key (the rest
    is unspecified), and `num_segments`, a 1-element tensor on the device (its value is never read on the host).
    The kernel reads a segment's key beside its start rather than through it: one dependent load less."""
    n = keys.numel()
    is_start = torch.empty(n, dtype=torch.bool, device=keys.device)
    is_start[:1].fill_(True)  # `is_start[0] = True` would copy a host scalar: a sync on CUDA
    torch.ne(keys[1:], keys[:-1], out=is_start[1:])
    count = torch.cumsum(is_start, 0)  # segments up to each occurrence
    # Segment k's first index and key go to slot k, every other occurrence's to the dump slot n (mask indexing
    # instead would need the count on the host for its output size).
    slot = torch.where(is_start, count - 1, n)
    starts = torch.empty(n + 1, dtype=torch.int64, device=keys.device)
    starts.scatter_(0, slot, torch.arange(n, device=keys.device))
    segment_keys = torch.empty(n + 1, dtype=keys.dtype, device=keys.device)
    segment_keys.scatter_(0, slot, keys)
    return starts, segment_keys, count[-1:]


@triton.jit(do_not_specialize=["num_values"])  # one compiled binary serves every batch (kernels/launch.py)
def _embedding_backward_kernel(
    starts_ptr, keys_ptr, num_segments_ptr, num_values,  # segments(): first occurrence and key (table << 32 | row)
    grad_ptr, grad_offsets_ptr, scales_ptr,  # per occurrence, in key order: where its gradient starts, its scale
    table_ptrs, momentum_ptrs, dims_ptr,  # per table: weight address, momentum address, dim
    lr, eps,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TABLE_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr,
    ADAGRAD: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    # Persistent: the grid does not depend on the segment count (on the device only), so the programs stride over
    # the segments (`while`: the interpreter cannot range() over loaded values).
    num_segments = tl.load(num_segments_ptr)
    seg = tl.program_id(0)
    while seg < num_segments:
        j = tl.load(starts_ptr + seg)
        end = tl.load(starts_ptr + seg + 1, mask=seg + 1 < num_segments, other=num_values)  # last: to the end
        key = tl.load(keys_ptr + seg)
        t = key >> 32
        row = key - (t << 32)
        dim = tl.load(dims_ptr + t)
        d_mask = d < dim
        # The row is this program's alone (keys are unique per segment): plain read-modify-write, no atomics. Its
        # loads are issued before the gradients' so that their latencies overlap.
        table = tl.load(table_ptrs + t).to(tl.pointer_type(TABLE_DTYPE))
        w_ptrs = table + row * dim + d
        w = tl.load(w_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        if ADAGRAD:
            momentum = tl.load(momentum_ptrs + t).to(tl.pointer_type(tl.float32)) + row
            m_row = tl.load(momentum)

        # Sum the gradients of the segment's occurrences, BLOCK_N at a time. Columns past the table's dim load as
        # 0 and stay 0.
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

        if ADAGRAD:
            m_row = m_row + tl.div_rn(tl.sum(acc * acc, axis=0), dim.to(tl.float32))
            tl.store(momentum, m_row)
            # IEEE sqrt and division (tl.sqrt and `/` are approximate on GPUs), as the torch path computes them.
            w = w - acc * tl.div_rn(lr, tl.sqrt_rn(m_row) + eps)
        else:
            w = w - lr * acc
        tl.store(w_ptrs, w.to(TABLE_DTYPE), mask=d_mask)
        seg += tl.num_programs(0)


class BackwardTables:
    """Metadata of one backward launch, built once: per table its address, momentum address and dim; per owned
    feature (output column order) its table, first output column and pooling."""

    def __init__(self, weights: list[torch.Tensor], momentum: list[torch.Tensor] | None, feature_tables: list[int],
                 mean: list[bool], device: torch.device):
        """momentum: the optimizer's fp32 [rows] state of each table (row-wise Adagrad), None for SGD."""
        self.dtype = common_table_dtype(weights)
        for w in weights:
            if w.shape[0] >= 2**31 or not w.is_contiguous():  # the row is the low 32 bits of the sort key
                raise ValueError(f"tables must be contiguous with < 2**31 rows, got {tuple(w.shape)}")
        if momentum is not None and any(m.dtype != torch.float32 or m.shape != w.shape[:1]
                                        for m, w in zip(momentum, weights, strict=True)):
            raise ValueError("momentum must be fp32 [rows] per table")
        self.weights, self.momentum = weights, momentum  # keep alive the tensors whose addresses the kernel reads
        self.addresses = self._addresses(weights, momentum)
        dims = [w.shape[1] for w in weights]
        feature_dims = [dims[t] for t in feature_tables]

        def tensor(values, dtype):
            return torch.tensor(values or [0], dtype=dtype, device=device)

        self.table_ptrs = tensor([w.data_ptr() for w in weights], torch.int64)
        # SGD has no state: the kernel never reads these addresses.
        self.momentum_ptrs = tensor([m.data_ptr() for m in momentum] if momentum else [0] * len(weights),
                                    torch.int64)
        self.dims = tensor(dims, torch.int32)
        self.feature_table = tensor(feature_tables, torch.int64)
        self.cols = tensor([sum(feature_dims[:i]) for i in range(len(feature_dims))], torch.int64)
        self.mean = tensor(mean, torch.bool)
        self.any_mean = any(mean)
        self.row_len = sum(feature_dims)  # width of the pooled output and of its gradient
        self.block_dim = triton.next_power_of_2(max(dims or [1]))

    @staticmethod
    def _addresses(weights, momentum) -> tuple[int, ...]:
        return tuple(w.data_ptr() for w in weights) + tuple(m.data_ptr() for m in momentum or [])

    def describes(self, weights: list[torch.Tensor], momentum: list[torch.Tensor] | None) -> bool:
        """Whether these are still the tensors it was built for (host-only check: no device work)."""
        return self._addresses(weights, momentum) == self.addresses


def launch_embedding_backward(bags: OwnedBags, grad: torch.Tensor, tables: BackwardTables,
                              config: EmbeddingOptimizerConfig) -> None:
    """Update every owned table in place (and the row-wise Adagrad momentum in `tables.momentum`) from the
    gradient of the pooled output `grad` [global batch, owned dims]. No host sync, one kernel launch."""
    adagrad = config.name == "rowwise_adagrad"
    if adagrad and tables.momentum is None:
        raise ValueError("row-wise Adagrad needs the momentum of every table")
    values, lengths = bags.values, bags.lengths.reshape(-1)
    n, batch = values.numel(), bags.global_batch
    if grad.shape != (batch, tables.row_len):
        raise ValueError(f"gradient of shape {tuple(grad.shape)}, expected {(batch, tables.row_len)}")
    if n == 0:  # no occurrence: no row to update (and no sync)
        return
    grad = grad.float().contiguous()
    device = values.device

    # Per occurrence: its bag (feature-major: f * batch + b), hence feature and sample. output_size avoids a sync.
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=n)
    feature = bag // batch
    grad_offsets = (bag - feature * batch) * tables.row_len + tables.cols[feature]
    keys = (tables.feature_table[feature] << 32) | values
    scales = None
    if bags.weights is not None:
        scales = bags.weights.float()
    if tables.any_mean:
        inv_len = torch.where(tables.mean[feature], 1.0 / lengths.clamp(min=1).float()[bag], 1.0)
        scales = inv_len if scales is None else scales * inv_len

    # Group the occurrences of each (table, row); stable, so a segment sums in occurrence order.
    keys, order = torch.sort(keys, stable=True)
    grad_offsets = grad_offsets[order]
    if scales is not None:
        scales = scales[order]
    starts, segment_keys, num_segments = segments(keys)

    args = (starts, segment_keys, num_segments, n,
            grad, grad_offsets, scales if scales is not None else grad_offsets,  # stand-in, never read
            tables.table_ptrs, tables.momentum_ptrs, tables.dims, config.lr, config.eps,
            max(1, TILE_ELEMENTS // tables.block_dim), tables.block_dim, TL_DTYPES[tables.dtype], scales is not None,
            adagrad)
    # What the binary's specialisation follows from besides the constexprs: the alignment of the tensors that
    # are views (the gradient may be one into a symmetric buffer; the segment count is the cumsum's last value);
    # the other tensors are fresh allocations or the tables' fixed metadata.
    key = (tables.dtype, tables.block_dim, scales is not None, adagrad, aligned(grad), aligned(num_segments))
    options = dict(num_warps=NUM_WARPS)
    # Persistent grid, sized without the segment count (at most n): as many programs as are resident at once
    # (from the compiled binary's registers and shared memory), so they all run in one wave and each walks its
    # share of the (mostly tiny) segments; a larger grid would leave a second wave of programs that start only
    # when the first ones have walked all of theirs. The interpreter runs programs one by one: few.
    programs = min(n, 4)
    binary = _LAUNCHES.compiled(key, (programs, 1, 1), args, options)
    if binary is not None:
        per_sm = resident_programs_per_sm(binary.n_regs, NUM_WARPS, binary.metadata.shared)
        programs = min(n, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)
    _LAUNCHES(key, (programs, 1, 1), args, options)


_LAUNCHES = CompiledLaunches(_embedding_backward_kernel)
