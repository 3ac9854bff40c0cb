"""Timing and bandwidth probes shared by the benchmarks and the reports: median of many, slowest rank.

On GPUs a run is timed with CUDA events; on the CPU with the host's perf_counter. Without a process group (one
process) the ranks' line-up and the max over ranks are skipped.

Two ways to line the ranks up before a timed run (`time_ms(start=...)`):
- "host": a process-group barrier, then each rank records its start and enqueues. A rank whose host leaves the
  barrier later starts later, and a collective's time on the other rank includes that skew.
- "device": the same, then a barrier kernel across the GPUs (symmetric memory) and a head start (a GPU sleep
  longer than enqueueing the run), then the start event. Both GPUs start the run together with it already
  enqueued: the run's device time, as a step in a loop that runs ahead of its host sees it.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


HEAD_START_CYCLES = 2_000_000  # ~1 ms at the H100 / H200 clocks: longer than any run's enqueue timed here


@functools.cache
def _device_barrier(device: torch.device):
    """The world's symmetric-memory handle whose barrier() lines the GPUs up on the current stream."""
    from torch.distributed import _symmetric_memory as symm_mem

    buf = symm_mem.empty(1, device=device)
    return symm_mem.rendezvous(buf, dist.group.WORLD)


def _run_ms(fn: Callable[[], object], device: torch.device, on_device: bool = False,
            head_start_cycles: int = HEAD_START_CYCLES) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if on_device:
            _device_barrier(device).barrier(channel=0)
            torch.cuda._sleep(head_start_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1e3


def time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50, device: torch.device | None = None,
            start: str = "host", head_start_cycles: int = HEAD_START_CYCLES) -> float:
    """Median over `iters` runs of fn (after `warmup` runs), ranks lined up before each run; the slowest rank's
    median. device: where fn works (CUDA events there, host timer on the CPU); None: the current GPU.
    start: how the ranks are lined up, "host" or "device" (GPUs of a group of several ranks; see the module);
    head_start_cycles: the GPU sleep of a "device" start (time the same call at two: if they agree, the host's
    enqueueing was hidden)."""
    if start not in ("host", "device"):
        raise ValueError(f"start must be 'host' or 'device', not {start!r}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    grouped = dist.is_initialized()
    on_device = start == "device" and grouped and device.type == "cuda" and dist.get_world_size() > 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if grouped:
            dist.barrier()
        times.append(_run_ms(fn, device, on_device, head_start_cycles))
    median = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    if grouped:
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


def per_call_us(fn: Callable[[], object], calls: int = 20, warmup: int = 10, iters: int = 50) -> float:
    """Microseconds per call of fn, timed over `calls` back-to-back calls (launch overhead included, as in a
    model where the next call follows at once); warmup and iters count such runs of `calls` calls."""
    def run():
        for _ in range(calls):
            fn()
    return time_ms(run, warmup, iters) * 1e3 / calls
