"""One GPU: the GEMM + all-reduce at a training step's rows (M in the thousands) for several tilings, against
cuBLAS x @ w; µs per call of 10 back-to-back calls (bench.timing.per_call_us: median of 10 runs; a call is far
longer than its launch), two rounds of every variant alternating.

  produce: rank 0 of a simulated world of 2, two-shot, produce phase alone (half the tiles' fp32 partials into
           the other rank's slots, on the same GPU; nothing waits): the GEMM's share of a 2-rank call
  world 1: a world of one rank, all phases in one launch (partials stored, reduced, output written; no peer)

    PYTHONPATH=. python scripts/one_gpu/gemm_allreduce_rows.py
"""
import torch

from fused_dlrm.bench.timing import per_call_us
from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.gemm_allreduce import PRODUCE, GemmAllReduce

VARIANTS = {  # name: GemmAllReduce's tiling arguments (none: its default for many rows, MANY_ROWS)
    "64x64x128 w8 s3 2/SM": dict(block_m=64, block_n=64, block_k=128, num_stages=3, programs_per_sm=2),
    "128x128x64 w8 s3 1/SM": dict(block_m=128, block_n=128, block_k=64, num_stages=3, programs_per_sm=1),
    "128x128x64 w8 s4 1/SM": dict(block_m=128, block_n=128, block_k=64, num_stages=4, programs_per_sm=1),
    "128x64x64 w4 s4 2/SM": dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, programs_per_sm=2),
    "64x128x64 w4 s4 2/SM": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, programs_per_sm=2),
    "128x256x64 w8 s3 1/SM (MANY_ROWS)": dict(),
    "128x256x64 w8 s4 1/SM": dict(num_stages=4),
    "256x128x64 w8 s3 1/SM": dict(block_m=256, block_n=128),
}
SHAPES = [(4096, 2048, 4096), (8192, 4096, 4096), (16384, 704, 2048), (8192, 1024, 2048)]  # M, K per rank, N

for m, k, n in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    expected = (x.float() @ w.float())
    calls = {"cublas": lambda: x @ w}
    for name, v in VARIANTS.items():
        produce = GemmAllReduce(SimulatedWorld(2, "cuda").workspaces()[0], algorithm="two_shot", **v)
        produce.prepare(x, w, PRODUCE)
        whole = GemmAllReduce(SimulatedWorld(1, "cuda").workspaces()[0], algorithm="two_shot", **v)
        err = float((whole(x, w).float() - expected).abs().max() / expected.abs().max())
        calls[f"{name} produce"] = lambda op=produce: op.launch(x, w, 1, PRODUCE)
        calls[f"{name} world 1"] = lambda op=whole: op(x, w)
        print(f"  {name}: world-1 relative error {err:.1e}", flush=True)
    times = {key: [] for key in calls}
    for _ in range(2):
        for key, fn in calls.items():
            times[key].append(per_call_us(fn, calls=10, warmup=2, iters=10))
    print(f"M={m} K={k} N={n} ({2 * m * k * n / times['cublas'][0] / 1e6:.0f} TFLOP/s cuBLAS)")
    for key, t in times.items():
        print(f"  {key:36} {', '.join(f'{v:.1f}' for v in t)}  ({t[0] / times['cublas'][0]:.2f}x cuBLAS)",
              flush=True)
