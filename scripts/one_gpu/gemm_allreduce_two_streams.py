"""One GPU: the GEMM + all-reduce's one-launch form, one-shot against two-shot: a simulated world of 2 whose ranks
each launch the whole kernel (real waits on the other's flags) on a stream of their own, on half the SMs each (both
grids resident). µs per call of both ranks, GPU time (the streams sleep while the host enqueues), median of rounds,
each algorithm twice, alternating; cuBLAS x @ w on the same two streams as the compute-only baseline. The ranks
share one GPU's HBM and their flags go through its L2: this compares the protocols, not 2-GPU times.

    PYTHONPATH=. python scripts/one_gpu/gemm_allreduce_two_streams.py

(docs/benchmarks.md, ninth session, calls G3 and G7.)
"""
import statistics

import torch

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.gemm_allreduce import GemmAllReduce

sm = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = [(1, 4096, 8192), (1, 4096, 28672), (16, 4096, 8192), (64, 4096, 8192), (64, 4096, 28672)]
streams = [torch.cuda.Stream(), torch.cuda.Stream()]


def per_call(fn, iters=200, rounds=5):
    """GPU time per call: both streams first sleep while the host enqueues every call (so the host's launch cost
    does not show), timed from stream 0's first call to the later stream's end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        starts, ends = [], []
        for s in streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(120_000_000)  # ~60 ms at 1.98 GHz: longer than enqueueing the calls
                starts.append(torch.cuda.Event(enable_timing=True)); starts[-1].record()
        for _ in range(iters):
            fn()
        for s in streams:
            with torch.cuda.stream(s):
                ends.append(torch.cuda.Event(enable_timing=True)); ends[-1].record()
        torch.cuda.synchronize()
        out.append(max(starts[0].elapsed_time(e) for e in ends) / iters * 1e3)
    return statistics.median(out)


def on_streams(fns):
    def run():
        for fn, s in zip(fns, streams):
            with torch.cuda.stream(s):
                fn()
    return run


for programs_per_rank in (sm // 2,):
    ops = {a: [GemmAllReduce(ws, num_programs=programs_per_rank, algorithm=a, spin_limit=20_000_000)
               for ws in SimulatedWorld(2, "cuda").workspaces()] for a in ("one_shot", "two_shot")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in SHAPES:
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in range(2)]
        row = {"cublas": per_call(on_streams([lambda x=x, w=w: x @ w for x, w in zip(xs, ws)]))}
        for a, pair in [*ops.items(), *ops.items()]:  # twice, alternating
            a = a + ("" if a not in row else " again")
            try:
                for op, x, w in zip(pair, xs, ws):
                    op.prepare(x, w)
                row[a] = per_call(on_streams([lambda op=op, x=x, w=w: op(x, w) for op, x, w in zip(pair, xs, ws)]))
            except Exception as e:  # noqa
                row[a] = f"error {e}"
        for a, pair in ops.items():
            try:
                for op in pair:
                    op.errors.check(block=True)
            except Exception as e:
                row[a + " check"] = f"timeout {e}"
        print(f"programs/rank {programs_per_rank} M={m} K={k} N={n}: " +
              ", ".join(f"{a} {v:.1f}" if isinstance(v, float) else f"{a} {v}" for a, v in row.items()), flush=True)
