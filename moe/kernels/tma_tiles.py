"""The MoE backward GEMMs' transposed weight tiles: the stacked expert weights they need transposed (w13[e]^T,
w2[e]^T), read through TMA (fused_dlrm.kernels.tma) as they lie and transposed in shared memory.

Why: tl.dot wants a [K, N] tile, and such a weight tile lies [N, K]. Loaded through pointers, the two GEMMs ran
6-22% slower on an H200 than with the tile loaded by TMA as it lies and transposed in shared memory
(docs/benchmarks.md, 2026-11-24). Rows that peers stored are still read through pointers after their flags.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def transposed_weight_tile(w_desc, expert, n0, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w[expert]^T [k : k + BLOCK_K, n0 : n0 + BLOCK_N] from stacked weights w [experts, N, K] (descriptor block
    [1, BLOCK_N, BLOCK_K]). TMA offsets are 32-bit: int64 table entries are cast."""
    return tl.trans(w_desc.load([expert.to(tl.int32), n0, k]).reshape(BLOCK_N, BLOCK_K))
