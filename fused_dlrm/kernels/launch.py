"""Launching a Triton kernel through its compiled binary: a small call's host time.

`kernel[grid](*args)` binds the arguments, computes every argument's specialisation, hashes it into a cache key
and looks the binary up at every call: about 20 us of host time for a kernel of 20 arguments (H200 host,
triton 3.6), more than the kernel time of a small fused all-reduce. Calling the binary itself,
`binary[grid](*args)`, takes about 9 us.

A binary is only valid for the specialisation it was compiled for. Triton specialises every argument not marked
do_not_specialize on: its type (a tensor's dtype; an int's range: i32, i64 or u64), an int equal to 1 (then a
constexpr), an int divisible by 16, a tensor's address 16-byte aligned (`aligned`); do_not_specialize arguments
keep only their type. `CompiledLaunches` keeps one binary per key, and the key is the caller's promise: every
call under one key passes the same constexprs and options and arguments of the same specialisation. So a caller
keys on everything that specialisation follows from (shapes, strides, dtypes, the alignment of every tensor it
passes anew, the buffers it holds) and marks do_not_specialize the ints that change between calls of one key
(epochs), which must stay within the i32 range.

On GPUs the first call of a key compiles through `kernel.warmup` (Triton's own caches; nothing launched), so the
caller can read the binary's resources (`compiled`, `resident_programs_per_sm`) before choosing its grid; every
call launches the binary.
The interpreter (TRITON_INTERPRET=1) has no binaries: there every call goes through `kernel[grid]`, so CI, which
has no GPU, does not run the binary path.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Hashable

import torch


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CI's CPUs), which has no compiled
    binaries and takes no compiler options."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def aligned(t: torch.Tensor) -> bool:
    """Whether t's address is 16-byte aligned (Triton specialises pointer arguments on it)."""
    return t.data_ptr() % 16 == 0


# One sm_90 SM (H100, H200): what the programs resident on it share.
SM_REGISTERS = 65_536
SM_SHARED_BYTES = 228 * 1024
SM_THREADS = 2048
SM_PROGRAMS = 32
SHARED_RESERVED_PER_PROGRAM = 1024  # the CUDA runtime's per-block reservation (sm_80 and later)


def resident_programs_per_sm(n_regs: int, num_warps: int, shared: int) -> int:
    """How many programs of a binary (registers per thread, warps, bytes of shared memory per program) can be
    resident on one sm_90 SM at once: registers are allocated per thread in multiples of 8."""
    threads = 32 * num_warps
    by_registers = SM_REGISTERS // (-(-n_regs // 8) * 8 * threads)
    by_shared = SM_SHARED_BYTES // (shared + SHARED_RESERVED_PER_PROGRAM)
    return min(by_registers, by_shared, SM_THREADS // threads, SM_PROGRAMS)


def registers_per_thread(programs_per_sm: int, num_warps: int) -> int:
    """The most registers per thread (ptxas' maxnreg: a multiple of 8, or 255, the most) that leave room for
    `programs_per_sm` programs of `num_warps` warps on one sm_90 SM. Given no bound, ptxas takes what it likes, up
    to 255: one 8-warp program per SM."""
    return min(255, SM_REGISTERS // (programs_per_sm * 32 * num_warps) // 8 * 8)


class Arguments:
    """A kernel's argument list in its order, constexprs included, fixed but for the `per_call` names: built once
    per plan by name (no argument can land in the wrong place), filled per call by position."""

    def __init__(self, kernel, per_call: tuple[str, ...], **fixed):
        names = list(kernel.arg_names)
        if sorted(names) != sorted([*per_call, *fixed]):
            raise TypeError(f"{names} != per call {per_call} + fixed {sorted(fixed)}")
        self._slots = [names.index(n) for n in per_call]
        self._args = [fixed.get(n) for n in names]

    def __call__(self, *values) -> tuple:
        """The full argument tuple with the per-call values, in `per_call`'s order."""
        args = self._args.copy()
        for slot, value in zip(self._slots, values):
            args[slot] = value
        return tuple(args)


class CompiledLaunches:
    """One Triton kernel's compiled binaries by key (see the module docstring for what a key must determine).

    `args`: every argument of the kernel in its order, constexprs included (the binary takes them all, as
    `kernel[grid]` passes them); `options`: launch options (num_warps, ...), the same for every call of a key.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.interpret = interpreting()
        self._binaries: dict[Hashable, Any] = {}

    def compiled(self, key: Hashable, grid: tuple[int, int, int], args: tuple, options: dict):
        """The key's binary, compiled (not launched) on the first call; None in the interpreter."""
        binary = self._binaries.get(key)
        if binary is None and not self.interpret:
            binary = self.kernel.warmup(*args, grid=grid, **options)
            binary._init_handles()  # loads it: n_regs and the launcher exist from here on
            self._binaries[key] = binary
        return binary

    def __call__(self, key: Hashable, grid: tuple[int, int, int], args: tuple, options: dict) -> None:
        binary = self.compiled(key, grid, args, options)
        if binary is None:
            self.kernel[grid](*args, **options)
        else:
            binary[grid](*args)


class GraphReplays:
    """CUDA graphs of launches that repeat with exactly the same arguments, addresses included (a kernel whose
    per-call state lives on the device, like an epoch counter): a graph's replay costs ~2.6 us of host time, a
    launch through the binary ~9-10 us (H200 host, triton 3.6).

    The caller names a launch by a key that determines all of its arguments (the addresses of the tensors it
    passes anew); a key is captured the second time it comes (~1 ms), so tensors allocated anew at every call
    never cost a capture. Graphs are kept, never dropped: once `max_graphs` are held, other keys launch directly
    (dropping the oldest would capture anew at every call when more than max_graphs keys take turns). Keys seen
    once are remembered up to 4 x max_graphs, the oldest forgotten. Inside a caller's own graph capture the launch
    is made directly (and captured into the caller's graph)."""

    def __init__(self, max_graphs: int = 64):
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._seen = RecentKeys(4 * max_graphs)

    def __call__(self, key: Hashable, launch) -> None:
        """Replay key's graph, or run `launch()` (no arguments), capturing it first on the key's second call."""
        if torch.cuda.is_current_stream_capturing():  # inside a caller's capture: its graph takes the launch
            launch()
            return
        graph = self._graphs.get(key)
        if graph is None and key in self._seen and len(self._graphs) < self.max_graphs:
            graph = self._graphs[key] = capture_graph(launch)
        if graph is None:
            self._seen.add(key)
            launch()
        else:
            graph.replay()

    def __len__(self) -> int:
        return len(self._graphs)

    def graph(self, key: Hashable) -> torch.cuda.CUDAGraph | None:
        """key's graph, once captured."""
        return self._graphs.get(key)


class RecentKeys:
    """Keys seen lately: up to `limit`, the oldest forgotten first."""

    def __init__(self, limit: int):
        self.limit = limit
        self._keys: dict[Hashable, None] = {}

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def clear(self) -> None:
        self._keys.clear()


def capture_graph(launch, pool=None) -> torch.cuda.CUDAGraph:
    """launch()'s work captured (not run) into a graph, on a side stream (graphs cannot be captured on the
    default stream); errors of other threads' CUDA calls meanwhile are theirs (thread-local capture). `pool`: a
    memory pool shared with other graphs (torch.cuda.graph_pool_handle()), else one of its own.

    A graph allocates from a memory pool of its own, which cannot take the blocks that the default pool caches:
    the fine-grained MoE Transformer's first evaluation ran out of memory in its capture on 80 GB H100s, with
    15.8 GiB cached and unused and 174 MiB free (2026-11-26). So when the default pool caches more unused memory
    than the device has free, the cache is emptied first. Only then: emptying frees device memory, which waits for
    the whole device, and a simulated world's ranks on one GPU (tests/test_simulated_world_gpu.py) have a peer's
    kernel pending there that waits on this rank's launch (torch.cuda.graph, which always empties, hung them
    until their bounded waits failed).

    No garbage collection runs inside the capture: one there destroys unrelated garbage on this thread, and
    destroying a CUDA graph (an earlier training run's, held by a reference cycle) is not permitted while a stream
    captures: it invalidates the capture (2026-12-01, one H200: the direct step's test, whose second run captured
    its arch graphs while the first run's graphs were garbage; CUDAGraph::reset warned "operation not permitted
    when stream is capturing"). torch.cuda.graph collects before capturing instead: a full collection per capture."""
    cached_unused = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if cached_unused > torch.cuda.mem_get_info()[0]:
        torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    return graph
