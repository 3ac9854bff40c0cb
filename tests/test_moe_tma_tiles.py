"""The MoE backward GEMMs' TMA helpers: transposed weight tiles (interpreter on the CPU) against slices of w[e]^T,
zeros past the weight's edges; descriptors refuse tensors TMA cannot read, naming them."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.tma import descriptor
from moe.kernels.tma_tiles import transposed_weight_tile

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@triton.jit
def _tile_kernel(w_desc, out_ptr, experts_ptr, n0, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[program] = the [BLOCK_K, BLOCK_N] tile of w[experts[program]]^T at (k, n0)."""
    p = tl.program_id(0)
    tile = transposed_weight_tile(w_desc, tl.load(experts_ptr + p), n0, k, BLOCK_N, BLOCK_K)
    at = p * BLOCK_K * BLOCK_N + tl.arange(0, BLOCK_K)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + at, tile)


@pytest.mark.parametrize("n0,k", [(0, 0), (16, 32), (24, 40)])  # inside; past N's edge; past both edges
def test_transposed_tiles_equal_slices_of_the_transpose(n0, k):
    experts, n, kk, block_n, block_k = 3, 40, 56, 32, 32
    w = torch.randn(experts, n, kk, generator=torch.Generator().manual_seed(n0 + k))
    which = torch.tensor([2, 0, 1], dtype=torch.int64)  # int64, as the tile tables hold them
    out = torch.full((3, block_k, block_n), float("nan"))
    _tile_kernel[(3,)](descriptor(w, [1, block_n, block_k], "w"), out, which, n0, k, BLOCK_N=block_n,
                       BLOCK_K=block_k)
    for p, e in enumerate(which.tolist()):
        want = torch.zeros(block_k, block_n)
        part = w[e].t()[k:k + block_k, n0:n0 + block_n]
        want[:part.shape[0], :part.shape[1]] = part
        torch.testing.assert_close(out[p], want, rtol=0, atol=0)


def test_descriptor_refuses_what_tma_cannot_read():
    w = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    descriptor(w, [1, 16, 64], "w13")  # rows of 128 bytes: fine
    for bad in (torch.randn(4, 16, 20, dtype=torch.bfloat16),  # rows of 40 bytes
                w[:, :, 1:],  # an unaligned start
                w.transpose(1, 2)):  # last dim not contiguous
        with pytest.raises(ValueError, match="w13 .* through TMA"):
            descriptor(bad, [1, 8, 8], "w13")
