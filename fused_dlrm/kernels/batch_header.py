"""The input dist's header of one batch: what every destination must know before the batch's values travel.

Row r of the header goes to rank r: [local batch size, no batch (0 here), bad keys (0 here), values beyond the
lengths' sum, out-of-range indices (of keys a table reads), whether per-sample weights travel and in which dtype
(its `dtype_code`, 0 for none: their all-to-all is one more collective, which every rank must join or none, and
every rank sizes its buffers in its own dtype; WEIGHT_DTYPES are the ones it takes), the indices' dtype (its
`dtype_code`, one of INDEX_DTYPES: the values' all-to-all alike), then the value count of each feature rank r owns
(0 where rank r owns fewer features than the widest)]. Where this rank has no batch to send (it could not make it:
NO_BATCH) or its keys, its lengths' shape or its weights' count are wrong (BAD_KEYS, EXTRA_VALUES), the input dist
sends zeros and that one flag instead.

As torch ops this is ~20 small launches per batch: with them the header's start (its all-to-all and copy to the
host included) took 0.58-0.63 ms of host time per DLRM step, with the kernel 0.32-0.35 (one H200,
docs/benchmarks.md T4). Here the counts and their running ends are two torch ops and one kernel does the rest:
each program checks a block of values against the table of the key it falls in (a binary search over the keys'
ends) and adds its out-of-range count into every row; program 0 writes the other columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.launch import CompiledLaunches, aligned

# The header's columns: these, then each destination's per-feature value counts.
BATCH, NO_BATCH, BAD_KEYS, EXTRA_VALUES, OUT_OF_RANGE, WEIGHTS, INDICES, FIRST_COUNT = range(8)
_BATCH, _NO_BATCH, _BAD_KEYS, _EXTRA_VALUES, _OUT_OF_RANGE, _WEIGHTS, _INDICES, _FIRST_COUNT = (  # the kernel's
    tl.constexpr(c) for c in (BATCH, NO_BATCH, BAD_KEYS, EXTRA_VALUES, OUT_OF_RANGE, WEIGHTS, INDICES, FIRST_COUNT))
BLOCK_VALUES = 1024
# The dtypes the WEIGHTS and INDICES columns may name (`dtype_code`).
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
NOT_READ = -1  # the table size of a key no table reads: its indices are out of no range
_NOT_READ = tl.constexpr(NOT_READ)


def out_of_range(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Whether each index is outside [0, rows) of its key's table (rows: each value's; NOT_READ: never)."""
    return (rows != NOT_READ) & ((values < 0) | (values >= rows))


def tensor_dtype_code(t: torch.Tensor | None) -> int:
    """A header column's code of t's dtype: its `dtype_code`, 0 for no tensor."""
    return dtype_code(None if t is None else t.dtype)


def dtype_described(code: int, dtypes: tuple[torch.dtype, ...], what: str) -> str:
    """A `dtype_code` in words, for errors: "float16 weights", "no weights", "weights of a dtype other than ..."
    (a code of none of `dtypes`)."""
    if code == 0:
        return f"no {what}"
    if code in [dtype_code(d) for d in dtypes]:
        return f"{dtype_name(code)} {what}"
    return f"{what} of a dtype other than {', '.join(str(d).removeprefix('torch.') for d in dtypes)}"


def value_keys(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The key each value falls in by the counts. A search over the keys' ends, not an expansion sized by the
    value count (a KJT whose values and lengths disagree would overrun it); values past the lengths' sum fall in
    the last key."""
    return torch.searchsorted(torch.cumsum(counts, 0), torch.arange(values.numel(), device=values.device),
                              right=True).clamp_(max=counts.numel() - 1)


def batch_header_reference(values: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor,
                           header_keys: torch.Tensor, local_batch: int, weights: int) -> torch.Tensor:
    """The header [world, FIRST_COUNT + width] int64. counts: values per key [keys] int64; rows: each key's table
    size (NOT_READ: a key no table reads); header_keys [world, width]: the key of destination r's feature f
    (num_keys: padding); weights: the batch's per-sample weights' `tensor_dtype_code`."""
    bad = out_of_range(values, rows[value_keys(values, counts)]).sum()
    zero = torch.zeros_like(bad)
    first = torch.stack([torch.full_like(bad, local_batch), zero, zero, values.numel() - counts.sum(), bad,
                         torch.full_like(bad, int(weights)), torch.full_like(bad, tensor_dtype_code(values))])
    padded = torch.cat([counts, counts.new_zeros(1)])
    return torch.cat([first.expand(header_keys.shape[0], FIRST_COUNT), padded[header_keys]], dim=1)


@triton.jit(do_not_specialize=["n_values", "num_keys", "local_batch", "weights", "indices", "world", "width"])
def _batch_header_kernel(values_ptr, counts_ptr, ends_ptr, rows_ptr, header_keys_ptr, header_ptr,
                         n_values, num_keys, local_batch, weights, indices, world, width,
                         BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr, WORLD_BLOCK: tl.constexpr,
                         WIDTH_BLOCK: tl.constexpr):
    """header must hold zeros in its OUT_OF_RANGE column (the programs add into it)."""
    pid = tl.program_id(0)
    row_len = _FIRST_COUNT + width
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_values
    # The key of value i: the first key whose end (running sum of counts) exceeds i, the last key past them all.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_keys
    for _ in range(SEARCH_STEPS):  # a constexpr bound: ceil(log2(num_keys + 1)) halvings
        searching = live & (lo < hi)
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=searching, other=0)
        right = end <= i
        lo = tl.where(searching & right, mid + 1, lo)
        hi = tl.where(searching & ~right, mid, hi)
    key = tl.minimum(lo, num_keys - 1)
    limit = tl.load(rows_ptr + key, mask=live, other=0)
    v = tl.load(values_ptr + i, mask=live, other=0)
    n_bad = tl.sum((live & (limit != _NOT_READ) & ((v < 0) | (v >= limit))).to(tl.int64), axis=0)
    r = tl.arange(0, WORLD_BLOCK)
    row = header_ptr + r * row_len  # each destination's header row
    zero = tl.zeros([WORLD_BLOCK], dtype=tl.int64)
    tl.atomic_add(row + _OUT_OF_RANGE, zero + n_bad, mask=(r < world) & (n_bad > 0))
    if pid == 0:
        in_world = r < world
        tl.store(row + _BATCH, zero + local_batch, mask=in_world)
        tl.store(row + _NO_BATCH, zero, mask=in_world)
        tl.store(row + _BAD_KEYS, zero, mask=in_world)
        tl.store(row + _EXTRA_VALUES, zero + (n_values - tl.load(ends_ptr + num_keys - 1)), mask=in_world)
        tl.store(row + _WEIGHTS, zero + weights, mask=in_world)
        tl.store(row + _INDICES, zero + indices, mask=in_world)
        f = tl.arange(0, WIDTH_BLOCK)[None, :]
        cell = in_world[:, None] & (f < width)
        k = tl.load(header_keys_ptr + r[:, None] * width + f, mask=cell, other=0)
        count = tl.load(counts_ptr + k, mask=cell & (k < num_keys), other=0)
        tl.store(row[:, None] + _FIRST_COUNT + f, count, mask=cell)


_LAUNCHES = CompiledLaunches(_batch_header_kernel)


def batch_header(values: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, header_keys: torch.Tensor,
                 local_batch: int, weights: int) -> torch.Tensor:
    """batch_header_reference's header: the kernel on GPUs, the torch reference elsewhere."""
    if values.is_cuda and counts.numel() > 0:
        return launch_batch_header(values, counts, rows, header_keys, local_batch, weights)
    return batch_header_reference(values, counts, rows, header_keys, local_batch, weights)


def launch_batch_header(values: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, header_keys: torch.Tensor,
                        local_batch: int, weights: int) -> torch.Tensor:
    """The kernel, on the tensors' device (the CPU under TRITON_INTERPRET=1); at least one key."""
    world, width = header_keys.shape
    num_keys = counts.numel()
    values = values.contiguous()  # the kernel reads values[i] at values_ptr + i
    header = torch.zeros(world, FIRST_COUNT + width, dtype=torch.int64, device=values.device)
    constexprs = (BLOCK_VALUES, max(1, num_keys.bit_length()), triton.next_power_of_2(world),
                  triton.next_power_of_2(max(width, 1)))
    args = (values, counts, torch.cumsum(counts, 0), rows, header_keys, header, values.numel(), num_keys,
            local_batch, int(weights), tensor_dtype_code(values), world, width, *constexprs)
    # The specialisation besides the constexprs: the values' dtype and alignment (a KJT's values may be a view);
    # the other tensors are fresh allocations or a plan's own.
    key = (values.dtype, aligned(values), counts.dtype, rows.dtype, *constexprs)
    _LAUNCHES(key, (max(1, triton.cdiv(values.numel(), BLOCK_VALUES)), 1, 1), args, dict(num_warps=4))
    return header
