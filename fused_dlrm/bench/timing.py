"""Timing and bandwidth probes shared by the benchmarks: CUDA events, median of many, slowest rank."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist


def time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median over `iters` runs of fn, ranks lined up before each run; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def hbm_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s, read + write counted."""
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3)


def peer_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s one rank writes into the next rank's symmetric buffer while every rank does the same."""
    from torch.distributed import _symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes // 4, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    peer = handle.get_buffer((handle.rank + 1) % handle.world_size, (nbytes // 4,), torch.float32)
    src = torch.empty(nbytes // 4, device="cuda")
    ms = time_ms(lambda: peer.copy_(src), warmup=3, iters=10)
    return nbytes / (ms * 1e-3)
