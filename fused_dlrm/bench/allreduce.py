"""Benchmark section of `python -m fused_dlrm.bench tp`: quantized AllReduce (kernels/quantized_allreduce.py).

A bf16 message of each size is summed over the ranks, timed in the same run as:
  bulk:     NCCL all_reduce (dist.all_reduce, in place)
  fused:    the one-launch two-shot kernel with each codec (fp16 line, fp8, q8, q6, q4) into one preallocated
            output (out=; a new tensor per call would add its allocation, ~4 us of host time on the H200 hosts)
  baseline: torch's symmetric-memory two-shot all-reduce (torch.ops.symm_mem.two_shot_all_reduce_, in place on
            a symmetric buffer; the sums overflow after a few hundred calls, which does not change its time)
Each row also carries `twin_us`: the fused kernel's bulk twin (the codec kernels around NCCL all_to_all and
all_gather, kernels' arithmetic bit for bit), which since 2026-12-04 compares the ranks' calls first (one host
all-gather of 5 int64 over gloo: host time, hidden by back-to-back calls where the GPU's work is longer), and
`twin_check_us`: that check alone (the same at every size). Each codec's fused sum is checked first against its
twin's, bit for bit (a wrong result stops the bench on every rank; it is not timed). Times are per call from
back-to-back calls (the host's launch cost hides behind the GPU where it can). Speed of light: the codec's bytes
on the wire (each rank sends (world - 1) / world of the encoded message twice) / the peer write bandwidth measured
in this run; sol_pct = 100 * speed of light / fused time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_dlrm.bench.checks import check_against_bulk, different_elements
from fused_dlrm.bench.timing import peer_bandwidth, per_call_us
from fused_dlrm.dist.env import check_same_call, gloo_side_group
from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import describe_call
from fused_dlrm.tp.quantized_allreduce import fused_for_group, quantized_all_reduce, wire_bytes

SIZES = [32 << 10, 1 << 20, 64 << 20]  # bytes of bf16
QUICK_SIZES = [32 << 10, 64 << 20]


def symm_mem_two_shot(x: torch.Tensor):
    """torch's two-shot all-reduce in place on a symmetric copy of x; None where this torch has none."""
    from torch.distributed import _symmetric_memory as symm_mem

    two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_", None)
    if two_shot is None:
        return None
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group)
    buf.copy_(x)
    return lambda: two_shot(buf, "sum", group)


def run(quick: bool) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = peer_bandwidth()
    side = gloo_side_group(None)
    check_us = per_call_us(lambda: check_same_call([0] * 5, side, describe_call, "quantized all-reduce"))
    rows = []
    for nbytes in QUICK_SIZES if quick else SIZES:
        numel = nbytes // 2
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(numel, device="cuda", generator=gen).bfloat16()
        plain = x.clone()
        bulk_us = per_call_us(lambda: dist.all_reduce(plain))
        baseline = symm_mem_two_shot(x)
        baseline_us = per_call_us(baseline) if baseline else None
        out = torch.empty_like(x)
        for codec in CODECS:
            # A wrong result is not timed: the kernel's sum (into `out`, as timed) is its twin's bit for bit
            # (tests/*quantized_allreduce*).
            fused_sum = quantized_all_reduce(x, codec, fused=True, out=out).clone()
            check_against_bulk(f"AllReduce {codec} of {nbytes >> 10} KiB", fused_sum,
                               quantized_all_reduce(x, codec, fused=False), 0, "its bulk twin", different_elements)
            fused_us = per_call_us(lambda: quantized_all_reduce(x, codec, fused=True, out=out))
            twin_us = per_call_us(lambda: quantized_all_reduce(x, codec, fused=False, out=out))
            wire = wire_bytes(numel, world, codec)
            rows.append({"op": f"AllReduce {codec}", "shape": f"{nbytes >> 10} KiB ({numel} values)",
                         "dtype": "bf16", "bulk_us": bulk_us, "fused_us": fused_us,
                         "baseline_name": "symm_mem two_shot", "baseline_us": baseline_us,
                         "speedup": bulk_us / fused_us, "sol_pct": 100 * wire / peer * 1e6 / fused_us,
                         "twin_us": twin_us, "twin_check_us": check_us})
    fused_for_group(None, x.device).errors.check(block=True)
    return rows
