"""Benchmark section of `python -m fused_dlrm.bench tp`: GEMV/GEMM + AllReduce (row-parallel linear).

A row-parallel linear of K in-features: out[M, N] = sum over ranks r of x_r[M, K / world] @ w_r[K / world, N]
(issue 5's shapes name the layer's K, split over the ranks), bf16, timed in the same run as:
  bulk:     x @ w, then NCCL all_reduce (the bulk twin)
  fused:    kernels.gemm_allreduce (one persistent launch), a row for each algorithm (one-shot: what "auto"
            takes for the decode-sized shapes on 2 ranks; two-shot); at a training step's rows also its
            reduce-scatter form against matmul + reduce_scatter_tensor
  baseline: x @ w into a symmetric buffer, then torch's symmetric-memory one-shot all-reduce
Before a fused row is timed, its result is checked against the bulk twin's (relative error, TOLERANCE): a wrong
one raises on every rank. Every time is per call, from back-to-back calls (so the host's launch cost hides behind
the GPU where it can).
Speed of light: max(weight bytes / device copy bandwidth, output bytes / peer write bandwidth (the reduce-scatter:
one band's), cuBLAS's x @ w alone), all measured in this run; sol_pct = 100 * speed of light / fused time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_dlrm.bench.checks import check_against_bulk
from fused_dlrm.bench.timing import hbm_bandwidth, peer_bandwidth, per_call_us
from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace
from fused_dlrm.kernels.gemm_allreduce import GemmAllReduce, gemm_allreduce_bulk, gemm_reduce_scatter_bulk

# M, K, N: decode-sized (issue 5's), then a training step's tokens (MANY_ROWS's tiles)
SHAPES = [(1, 8192, 8192), (1, 8192, 28672), (16, 8192, 8192), (64, 8192, 8192), (64, 8192, 28672),
          (4096, 8192, 4096), (16384, 1408, 2048)]
QUICK_SHAPES = SHAPES[:2]
# bf16 outputs (2^-9 relative per rounding): the bulk twin rounds each rank's product and its sums, the fused op
# its sum once; 1e-2 allows a few roundings (the kernel tests' bound)
TOLERANCE = 1e-2


def symm_mem_baseline(x: torch.Tensor, w: torch.Tensor):
    """matmul into a symmetric buffer, then torch's one-shot all-reduce; None where this torch has none."""
    from torch.distributed import _symmetric_memory as symm_mem

    one_shot = getattr(torch.ops.symm_mem, "one_shot_all_reduce", None)
    if one_shot is None:
        return None
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(x.shape[0] * w.shape[1], dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group)
    out = buf.view(x.shape[0], w.shape[1])

    def run():
        torch.matmul(x, w, out=out)
        return one_shot(buf, "sum", group)
    return run


def run(quick: bool) -> list[dict]:
    rank = dist.get_rank()
    hbm, peer = hbm_bandwidth(), peer_bandwidth()
    workspace = CudaSymmetricWorkspace()
    ops = {algorithm: GemmAllReduce(workspace, algorithm=algorithm) for algorithm in ("one_shot", "two_shot")}
    rows = []
    world = dist.get_world_size()
    for m, k_layer, n in QUICK_SHAPES if quick else SHAPES:
        k = k_layer // world
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        bulk_us = per_call_us(lambda: gemm_allreduce_bulk(x, w))
        baseline = symm_mem_baseline(x, w)
        baseline_us = per_call_us(baseline) if baseline else None
        weight_us, matmul_us = k * n * w.element_size() / hbm * 1e6, per_call_us(lambda: x @ w)
        light_us = max(weight_us, m * n * x.element_size() / peer * 1e6, matmul_us)
        shape = f"M={m} K={k_layer} ({k}/rank) N={n}"
        bulk = gemm_allreduce_bulk(x, w)
        for algorithm, op in ops.items():
            check_against_bulk(f"GEMM + AllReduce {algorithm} {shape}", op(x, w), bulk, TOLERANCE)
            fused_us = per_call_us(lambda: op(x, w))
            rows.append({"op": f"GEMM + AllReduce {algorithm}", "shape": shape,
                         "dtype": "bf16", "bulk_us": bulk_us, "fused_us": fused_us,
                         "baseline_name": "matmul + symm_mem one_shot", "baseline_us": baseline_us,
                         "speedup": bulk_us / fused_us, "sol_pct": 100 * light_us / fused_us})
        if m % world == 0 and m > 64:  # a training step's rows: the reduce-scatter form (sequence parallelism)
            check_against_bulk(f"GEMM + ReduceScatter {shape}", ops["two_shot"].reduce_scatter(x, w),
                               gemm_reduce_scatter_bulk(x, w), TOLERANCE)
            bulk_us = per_call_us(lambda: gemm_reduce_scatter_bulk(x, w))
            fused_us = per_call_us(lambda: ops["two_shot"].reduce_scatter(x, w))
            light_us = max(weight_us, m * n * x.element_size() / world / peer * 1e6, matmul_us)  # its band only
            rows.append({"op": "GEMM + ReduceScatter", "shape": shape,
                         "dtype": "bf16", "bulk_us": bulk_us, "fused_us": fused_us, "baseline_name": None,
                         "baseline_us": None, "speedup": bulk_us / fused_us, "sol_pct": 100 * light_us / fused_us})
    for op in ops.values():
        op.errors.check(block=True)
    return rows
