"""The input dist's regroup of a tensor's segments into another order, on the device, in one kernel.

    gather_segments(x, counts, order, total) -> out [total]

x is made of segments, segment i being counts[i] consecutive elements ([n] int64 counts, on x's device); `order`
lists segments (each at most once, or several times: a feature bound for several ranks) and `total` is their
summed size (known on the host). out holds segment order[0]'s elements, then order[1]'s, and so on.

The reference builds a gather index from running sums and a repeat_interleave (~8 torch ops) and gathers with
it: twice per batch (the send regroup and the received one) that was ~0.47 ms of the host's time per DLRM paper
step under cProfile, on the path of the step's prefetch (2×H200, 2026-11-28, docs/benchmarks.md). The kernel is
one launch: program (j, p) copies part p of output segment j, whose source and destination starts it sums from
`counts` and `order` itself (both are short: one entry per feature or per (source, feature)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import CompiledLaunches, aligned

BLOCK_ELEMENTS = 1024  # elements a program copies per iteration
# Programs per output segment: about this many elements each, from the mean segment size (the sizes are on the
# device); a larger segment's programs take more iterations.
ELEMENTS_PER_PROGRAM = 8 * BLOCK_ELEMENTS


def segment_gather_index(counts: torch.Tensor, order: torch.Tensor, total: int) -> torch.Tensor:
    """The index that gathers x's segments in `order`: x[index] is gather_segments' result."""
    starts = torch.cumsum(counts, 0) - counts
    moved = counts[order]
    shift = starts[order] - (torch.cumsum(moved, 0) - moved)  # from each segment's new start to its old one
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(shift, moved, output_size=total)


def gather_segments_reference(x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, total: int) -> torch.Tensor:
    return x[segment_gather_index(counts, order, total)]


@triton.jit(do_not_specialize=["num_counts", "num_order"])
def _gather_segments_kernel(x_ptr, counts_ptr, order_ptr, out_ptr, num_counts, num_order,
                            BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    j = tl.program_id(0)  # the output segment
    part, parts = tl.program_id(1), tl.num_programs(1)
    k = tl.arange(0, LIST_BLOCK)
    counts = tl.load(counts_ptr + k, mask=k < num_counts, other=0)
    source = tl.load(order_ptr + j)
    src_start = tl.sum(tl.where(k < source, counts, 0), axis=0)
    size = tl.load(counts_ptr + source)
    placed = tl.load(order_ptr + k, mask=k < j, other=0)  # the segments before j in the output
    dst_start = tl.sum(tl.load(counts_ptr + placed, mask=k < j, other=0), axis=0)
    i = part.to(tl.int64) * BLOCK
    while i < size:
        offs = i + tl.arange(0, BLOCK)
        live = offs < size
        tl.store(out_ptr + dst_start + offs, tl.load(x_ptr + src_start + offs, mask=live), mask=live)
        i += parts * BLOCK


_LAUNCHES = CompiledLaunches(_gather_segments_kernel)


def gather_segments(x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, total: int) -> torch.Tensor:
    """The kernel on GPUs, the torch reference elsewhere; x of one dimension on both (the kernel moves elements, the
    reference would move rows of a 2-D x: it would pass on the CPU and fail on GPUs)."""
    if x.dim() != 1:
        raise ValueError(f"gather_segments: expected x of one dimension (a KJT's values or weights), got x of shape "
                         f"{tuple(x.shape)}")
    if x.is_cuda and order.numel() > 0:
        return launch_gather_segments(x, counts, order, total)
    return gather_segments_reference(x, counts, order, total)


def launch_gather_segments(x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, total: int) -> torch.Tensor:
    """The kernel, on the tensors' device (the CPU under TRITON_INTERPRET=1); x of one dimension, order not
    empty."""
    x, counts, order = x.contiguous(), counts.contiguous(), order.contiguous()  # read at ptr + i
    out = torch.empty(total, dtype=x.dtype, device=x.device)
    if total == 0:
        return out
    list_block = triton.next_power_of_2(max(counts.numel(), order.numel()))
    parts = min(max(1, triton.cdiv(total, order.numel() * ELEMENTS_PER_PROGRAM)), 65_535)  # a grid's y limit
    args = (x, counts, order, out, counts.numel(), order.numel(), BLOCK_ELEMENTS, list_block)
    # The specialisation besides the constexprs: dtypes and the alignment of x (a view: a KJT's values) and of
    # counts (a column block of the received header, made contiguous: a copy, or itself when already so).
    key = (x.dtype, aligned(x), counts.dtype, aligned(counts), order.dtype, BLOCK_ELEMENTS, list_block)
    _LAUNCHES(key, (order.numel(), parts, 1), args, dict(num_warps=4))
    return out
