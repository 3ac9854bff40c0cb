"""Time every pass of every layer in both modes on every rank; the slowest rank's median is reported.

Speed of light of a pass: the bytes the busiest rank sends in that mode (the fused column of a quantized all-reduce:
its codec's encoded messages; of an MoE layer: its exchanges by token's rows), at the peer write bandwidth measured
in this run (symmetric memory over NVLink, every rank writing at once); compute is not counted, so a layer that
computes much reads far below 100%. On the CPU there is no such bandwidth: "n/a" (null).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fused_dlrm.bench.timing import peer_bandwidth, time_ms
from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.symmetric import ranks_share_a_gpu
from fused_dlrm.report.layers import PASSES, CommLayer, bytes_of

log = logging.getLogger(__name__)

MODES = ("bulk", "fused")


def repeats(env: DistEnv) -> tuple[int, int]:
    """(warm-up runs, timed runs): fewer on the CPU, where host-timed runs are long and steady."""
    return (10, 50) if env.device.type == "cuda" else (1, 5)


def timing_method(env: DistEnv, warmup: int, iters: int) -> dict:
    """How time_ms took the times, written next to them."""
    return {"method": "CUDA events" if env.device.type == "cuda" else "host perf_counter",
            "warmup": warmup, "iters": iters, "statistic": "median over iters, slowest rank"}


def shared_gpu(env: DistEnv) -> bool:
    """Whether ranks of this run share a GPU (a check of results: their times are no comparison)."""
    return env.device.type == "cuda" and env.world_size > 1 and ranks_share_a_gpu(dist.group.WORLD)


def measure_bandwidth(env: DistEnv, shared: bool) -> float | None:
    """Peer write bandwidth in bytes/s, or None where it cannot be measured (CPU, one process, ranks sharing a GPU
    (`shared`): no symmetric memory between them, and no peer link to measure)."""
    if env.device.type != "cuda" or env.world_size == 1 or shared:
        return None
    return peer_bandwidth()


def max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_layer(layer: CommLayer, env: DistEnv, bandwidth: float | None, warmup: int, iters: int) -> dict:
    """The layer's entry of report.json: bytes, times (ms) per mode and pass, speedups, % of speed of light."""
    most = max_over_ranks([bytes_of(layer, mode).get(p, -1) for mode in MODES for p in PASSES], env.device)
    sent = {mode: {p: b for p, b in zip(PASSES, most[i * len(PASSES):]) if b >= 0} for i, mode in enumerate(MODES)}
    entry = {"name": layer.name, "shapes": layer.shapes, "count": layer.count, "notes": layer.notes,
             "bytes_sent": sent["bulk"]}
    if sent["fused"] != sent["bulk"]:  # a codec's encoded messages, MoE rows by token: the fused speed of light's
        entry["fused_bytes_sent"] = sent["fused"]
    for mode in MODES:
        passes = getattr(layer, mode)
        if isinstance(passes, str):
            entry[mode] = {"unavailable": passes}
            continue
        entry[mode] = {}
        for p in PASSES:
            if p in passes:
                log.info("report: timing %s, %s, %s", layer.name, mode, p)
                entry[mode][f"{p}_ms"] = time_ms(passes[p], warmup, iters, env.device)
    bulk, fused = entry["bulk"], entry["fused"]
    entry["speedup"] = {p: bulk[f"{p}_ms"] / fused[f"{p}_ms"] for p in PASSES
                        if f"{p}_ms" in bulk and f"{p}_ms" in fused}
    entry["pct_sol"] = {mode: {p: (100 * sent[mode][p] / bandwidth * 1e3 / entry[mode][f"{p}_ms"])
                               if bandwidth and p in sent[mode] else None
                               for p in PASSES if f"{p}_ms" in entry[mode]} for mode in MODES}
    return entry


def measure(layers: list[CommLayer], env: DistEnv) -> dict:
    """Time the layers; every rank takes part in every timing (the passes are collectives)."""
    warmup, iters = repeats(env)
    shared = shared_gpu(env)  # a collective: once
    bandwidth = measure_bandwidth(env, shared)
    entries = [measure_layer(layer, env, bandwidth, warmup, iters) for layer in layers]
    timing = timing_method(env, warmup, iters)
    if shared:
        timing["caveat"] = "the ranks share one GPU: the report checks results, its times compare nothing"
    return {"timing": timing,
            "peer_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None,
            "layers": entries}
