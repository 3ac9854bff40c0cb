"""One GPU: the GEMV + all-reduce's produce phase alone (rank 0 of a simulated world of 2, one-shot: every partial
into both ranks' slots; nothing waits) for the library's plan and other grids and K splits, against cuBLAS x @ w;
µs per call, GPU time (the stream sleeps while the host enqueues), median of 5 rounds of 100, two rounds of every
variant alternating.

    PYTHONPATH=. python scripts/one_gpu/gemm_allreduce_produce.py

(docs/benchmarks.md, ninth session: call G7 ran these variants, G5 and G6 others.)
"""
import statistics

import torch
from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.gemm_allreduce import PRODUCE, GemmAllReduce

sm = torch.cuda.get_device_properties(0).multi_processor_count


def gpu_us(fn, iters=100, rounds=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda._sleep(60_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / iters * 1e3)
    return statistics.median(out)


for m, k, n, variants in [
        (1, 4096, 28672, [dict(), dict(num_programs=264, split_k=2)]),
        (1, 4096, 8192, [dict(), dict(num_programs=132, split_k=2)]),
        (16, 4096, 8192, [dict(), dict(num_programs=132, split_k=2)]),
        (64, 4096, 28672, [dict()]),
        (1, 8192, 8192, [dict(), dict(num_programs=132, split_k=3)])]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    ops = []
    for v in variants:
        op = GemmAllReduce(SimulatedWorld(2, "cuda").workspaces()[0], algorithm="one_shot", **v)
        plan = op.prepare(x, w, PRODUCE)
        ops.append((v, op, plan))
    res = {str(v): [] for v, _, _ in ops}
    res["cublas"] = []
    for _ in range(2):
        res["cublas"].append(gpu_us(lambda: x @ w))
        for v, op, plan in ops:
            res[str(v)].append(gpu_us(lambda: op.launch(x, w, 1, PRODUCE)))
    print(f"M={m} K={k} N={n}")
    for (v, op, plan) in [(None, None, None)] + ops:
        key = "cublas" if v is None else str(v)
        extra = "" if v is None else f" (grid {plan.num_programs}, split_k {plan.split_k})"
        print(f"  {key:45} {', '.join(f'{t:.1f}' for t in res[key])}{extra}", flush=True)
