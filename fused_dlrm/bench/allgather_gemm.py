"""Benchmark section of `python -m fused_dlrm.bench tp`: AllGather + GEMM (column-parallel linear).

out [M, N / world] = all_gather(x_shard [M / world, K]) @ w [K, N / world] on every rank (N is the layer's full
output width, split over the ranks; w is a Linear's weight.t()), fp16, timed in the same run as:
  bulk:     NCCL all_gather_into_tensor, then torch.matmul (the bulk twin)
  fused:    kernels.allgather_gemm, one row per producer (copy_engine, device) and GEMM tile config
  baseline: torch.ops.symm_mem.fused_all_gather_matmul (x_shard in symmetric memory; torch's micro-pipeline)
A producer whose result differs from the bulk twin on any rank, or whose wait timed out (checked before timing),
is reported (every rank prints what it saw) and skipped (no row), so the other rows still print; any other error
of the fused op on one rank (a refused call, a peer's unlike call) raises on every rank. Every time is per call,
from back-to-back calls. Speed of light: max(GEMM flops / the rate of torch.matmul on the gathered input measured in
this run, bytes received from peers / peer write bandwidth measured in this run); sol_pct = 100 * speed of light /
fused time.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from fused_dlrm.bench.checks import relative_error
from fused_dlrm.bench.timing import peer_bandwidth, per_call_us
from fused_dlrm.dist.env import of_every_rank, problem_text, raise_on_every_rank
from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace
from fused_dlrm.kernels.allgather_gemm import (GEMM_PRODUCERS, GemmConfig, all_gather_matmul, all_gather_matmul_bulk,
                                               op_for)
from fused_dlrm.kernels.peer_flags import PeerWaitTimeout

SHAPES = [(8192, 11008, 4096), (4096, 11008, 4096), (16384, 8192, 8192)]  # M (gathered), N (all ranks), K
QUICK_SHAPES = SHAPES[:1]
# The device push's deal of local tiles (kernels/allgather_gemm.py, `lead_rounds`): estimated (default), and none
# (the pushers take their round-robin share from the start, as before 2026-11-26).
CONFIGS = {"128x256x64": GemmConfig(), "128x256x64, pushers skip no round": GemmConfig(push_rounds=0),
           "128x128x64": GemmConfig(block_n=128)}
QUICK_CONFIGS = dict(list(CONFIGS.items())[:1])


def torch_fused_all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor):
    """torch's fused op on a symmetric copy of x_shard; None where this torch has none."""
    from torch.distributed import _symmetric_memory as symm_mem

    op = getattr(torch.ops.symm_mem, "fused_all_gather_matmul", None)
    if op is None:
        return None
    group = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group)
    a = symm_mem.empty(*x_shard.shape, dtype=x_shard.dtype, device=x_shard.device)
    symm_mem.rendezvous(a, group)
    a.copy_(x_shard)
    return lambda: op(a, [w], 0, group, return_A=False)


def fused_failures(fused: Callable[[], str | None], what: str) -> list[str | None]:
    """Every rank's failure of `fused` (this rank's calls of the fused op; None: none): what it returned, or a
    timed-out wait's message. Any other error (a refused call, a peer's unlike call, an allocation) raises on every
    rank, `what` naming it on the others: a rank raising alone left its peers in the next collective."""
    failure, problem = None, None
    try:
        failure = fused()
    except PeerWaitTimeout as timeout:
        failure = str(timeout)
    except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
        problem = error
    every = of_every_rank((problem_text(problem), failure))
    raise_on_every_rank(problem, what, [text for text, _ in every])
    return [failure for _, failure in every]


def check_against_bulk(x, w, ws, producer: str, config: GemmConfig) -> str | None:
    """None if the fused result equals the bulk twin's on every rank (gathered input exact, output within 2e-3),
    else what failed (the same answer on every rank, so every rank skips the same rows; a rank whose own result
    passed names the first failing rank's); errors other than a timeout raise on every rank (`fused_failures`)."""
    bulk, bulk_gathered = all_gather_matmul_bulk(x, w)  # a collective: before anything can raise on one rank

    def fused() -> str | None:
        got, gathered = all_gather_matmul(x, w, ws, producer, return_gathered=True, config=config)
        op_for(ws, x, config).errors.check(block=True)
        error = relative_error(got, bulk)
        if not torch.equal(gathered, bulk_gathered) or not error <= 2e-3:
            return (f"relative error {error:.3g} against the bulk twin, gathered input "
                    f"{'exact' if torch.equal(gathered, bulk_gathered) else 'differs'}")
        return None

    failures = fused_failures(fused, f"failed the AllGather+GEMM {producer} check")
    failed = [rank for rank, failure in enumerate(failures) if failure is not None]
    if not failed:
        return None
    return failures[dist.get_rank()] or f"rank {failed[0]}: {failures[failed[0]]}"


def run(quick: bool) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = peer_bandwidth()
    ws = CudaSymmetricWorkspace()
    rows = []
    for m, n, k in QUICK_SHAPES if quick else SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(m // world, k, device="cuda", generator=gen).half()
        w = (torch.randn(n // world, k, device="cuda", generator=gen) / k ** 0.5).half().t()
        gathered = torch.randn(m, k, device="cuda", generator=gen).half()
        matmul_us = per_call_us(lambda: torch.matmul(gathered, w))
        bulk_us = per_call_us(lambda: all_gather_matmul_bulk(x, w))
        baseline = torch_fused_all_gather_matmul(x, w)
        baseline_us = per_call_us(baseline) if baseline else None
        light_us = max(matmul_us, (world - 1) * x.numel() * x.element_size() / peer * 1e6)
        shape = f"M={m} N={n} (/{world}) K={k}"
        for name, config in (QUICK_CONFIGS if quick else CONFIGS).items():
            for producer in GEMM_PRODUCERS:
                failure = check_against_bulk(x, w, ws, producer, config)
                if failure is not None:
                    print(f"rank {rank}: AllGather+GEMM {producer} {name} {shape}: SKIPPED, {failure}", flush=True)
                    continue
                fused_us = per_call_us(lambda: all_gather_matmul(x, w, ws, producer, config=config))
                rows.append({"op": f"AllGather+GEMM {producer} {name}", "shape": shape, "dtype": "fp16",
                             "bulk_us": bulk_us, "fused_us": fused_us,
                             "baseline_name": "symm_mem fused_all_gather_matmul", "baseline_us": baseline_us,
                             "speedup": bulk_us / fused_us, "sol_pct": 100 * light_us / fused_us,
                             "matmul_us": matmul_us})
            timeout = fused_failures(lambda: op_for(ws, x, config).errors.check(block=True),
                                     f"failed while AllGather+GEMM {name} {shape} was timed")[rank]
            if timeout is not None:
                print(f"rank {rank}: AllGather+GEMM {name} {shape}: timed out while timing: {timeout}", flush=True)
    return rows
