"""The segments (runs of equal keys) of sorted keys, on the device, in two launches and without a host sync.

    sorted_segments(keys) -> (starts, segment_keys, num_segments)

For sorted `keys` [n > 0]: the first `num_segments` entries of `starts` (int64, at least n entries) and of
`segment_keys` ([n], keys' dtype) are each segment's first index and key, the rest is unspecified;
`num_segments` is a 1-element int64 tensor on the device (its value is never read on the host). The embedding
backward's kernels walk these tables (kernels/embedding_backward.py; keys t << row_bits | row), reading a
segment's key beside its start rather than through it: one dependent load less.

The torch reference marks each segment's start, numbers the segments by a running sum and scatters (about a
dozen ops, each a launch of host time and a pass over n keys: ~0.25 ms of the DLRM paper step's host time under
cProfile, one H200, docs/benchmarks.md 2026-11-29). The kernels: programs take consecutive ranges of tiles;
the first launch counts each range's segment starts, the second sums the counts of the ranges before its own
(at most MAX_PROGRAMS of them: one load) and writes its starts and keys at their places, a tile at a time
(an exclusive running sum inside the tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import CompiledLaunches, aligned

TILE = 1024  # keys a program reads at a time
MAX_PROGRAMS = 1024  # a program's range grows past one tile beyond this many tiles


def sorted_segments_reference(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch definition (`starts` has 2n entries here). No op needs a value on the host: it runs on the
    meta device."""
    n = keys.numel()
    is_start = torch.empty(n, dtype=torch.bool, device=keys.device)
    is_start[:1].fill_(True)  # `is_start[0] = True` would copy a host scalar: a sync on CUDA
    torch.ne(keys[1:], keys[:-1], out=is_start[1:])
    segment = torch.cumsum(is_start, 0) - 1  # of each occurrence
    positions = torch.arange(n, device=keys.device)
    # Segment k's first index goes to slot k, every other occurrence's index to a slot of its own past n (mask
    # indexing instead would need the count on the host; one shared dump slot serialises ~n stores on a GPU).
    starts = torch.empty(2 * n, dtype=torch.int64, device=keys.device)
    starts.scatter_(0, torch.where(is_start, segment, n + positions), positions)
    # The occurrences of a segment share its key: whichever store lands, slot k holds it.
    segment_keys = torch.empty(n, dtype=keys.dtype, device=keys.device)
    segment_keys.scatter_(0, segment, keys)
    return starts, segment_keys, segment[-1:] + 1


@triton.jit
def _tile_starts(keys_ptr, i, n):
    """Which of the keys i (a tile of indices) start a segment (the first key, or one unlike its predecessor),
    and the keys."""
    live = i < n
    key = tl.load(keys_ptr + i, mask=live)
    previous = tl.load(keys_ptr + i - 1, mask=live & (i > 0))
    return live & ((i == 0) | (key != previous)), key


@triton.jit(do_not_specialize=["n", "tiles_per_program"])
def _count_starts_kernel(keys_ptr, counts_ptr, n, tiles_per_program, TILE: tl.constexpr):
    p = tl.program_id(0)
    count = 0
    t = 0
    while t < tiles_per_program:  # `while`: the interpreter cannot range() over an argument
        i = (p * tiles_per_program + t).to(tl.int64) * TILE + tl.arange(0, TILE)
        is_start, _ = _tile_starts(keys_ptr, i, n)
        count += tl.sum(is_start.to(tl.int32), axis=0)
        t += 1
    tl.store(counts_ptr + p, count)


@triton.jit(do_not_specialize=["n", "tiles_per_program"])
def _write_segments_kernel(keys_ptr, counts_ptr, starts_ptr, segment_keys_ptr, num_segments_ptr, n,
                           tiles_per_program, TILE: tl.constexpr, MAX_PROGRAMS: tl.constexpr):
    p = tl.program_id(0)
    q = tl.arange(0, MAX_PROGRAMS)
    slot = tl.sum(tl.load(counts_ptr + q, mask=q < p, other=0), axis=0).to(tl.int64)  # segments before my range
    t = 0
    while t < tiles_per_program:
        i = (p * tiles_per_program + t).to(tl.int64) * TILE + tl.arange(0, TILE)
        is_start, key = _tile_starts(keys_ptr, i, n)
        starts = is_start.to(tl.int32)
        place = slot + (tl.cumsum(starts, axis=0) - starts)  # the segments before each start in the tile
        tl.store(starts_ptr + place, i, mask=is_start)
        tl.store(segment_keys_ptr + place, key, mask=is_start)
        slot += tl.sum(starts, axis=0)
        t += 1
    if p == tl.num_programs(0) - 1:
        tl.store(num_segments_ptr, slot)


_COUNT_LAUNCHES = CompiledLaunches(_count_starts_kernel)
_WRITE_LAUNCHES = CompiledLaunches(_write_segments_kernel)


def sorted_segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels on GPUs, the torch reference elsewhere."""
    if keys.is_cuda:
        return launch_sorted_segments(keys)
    return sorted_segments_reference(keys)


def launch_sorted_segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels, on keys' device (the CPU under TRITON_INTERPRET=1); n > 0."""
    keys = keys.contiguous()  # read at ptr + i (a sort's output already is: no copy)
    n = keys.numel()
    tiles = triton.cdiv(n, TILE)
    tiles_per_program = triton.cdiv(tiles, MAX_PROGRAMS)
    programs = triton.cdiv(tiles, tiles_per_program)
    # One int64 allocation for starts, the count and the ranges' counts (each part at an even offset: 16-byte
    # aligned); the keys' own dtype for segment_keys.
    even = n + n % 2
    table = torch.empty(even + 2 + programs, dtype=torch.int64, device=keys.device)
    starts, num_segments, counts = table[:n], table[even:even + 1], table[even + 2:]
    segment_keys = torch.empty_like(keys)
    # The specialisation besides the constexprs: the keys' dtype and alignment (a fresh sort's output; the
    # other tensors are fresh allocations, their parts at 16-byte offsets).
    key = (keys.dtype, aligned(keys), TILE, MAX_PROGRAMS)
    options = dict(num_warps=4)
    _COUNT_LAUNCHES(key, (programs, 1, 1), (keys, counts, n, tiles_per_program, TILE), options)
    _WRITE_LAUNCHES(key, (programs, 1, 1), (keys, counts, starts, segment_keys, num_segments, n, tiles_per_program,
                                            TILE, MAX_PROGRAMS), options)
    return starts, segment_keys, num_segments
