"""The MoE backward GEMMs' operands read through TMA tensor descriptors (Hopper's tensor memory accelerator): the
stacked expert weights they need transposed (w13[e]^T, w2[e]^T), and rows that this GPU's own kernels wrote.

Why: tl.dot wants a [K, N] tile, and such a weight tile lies [N, K]. Loaded through pointers, the two GEMMs ran
6-22% slower on an H200 than with the tile loaded by TMA as it lies and transposed in shared memory
(docs/benchmarks.md, 2026-11-24; the all-gather GEMM's Linear weight, read the same way, gained nothing). A block's
parts outside the tensor read as zeros, so k tails need no masks. Rows that peers stored are still read through
pointers after their flags: TMA reads go through the async proxy, and nothing here orders those with the flags'
acquire.

Descriptors are built on the host (no device scratch allocator to install). TMA needs a 16-byte aligned start, a
contiguous last dim and 16-byte aligned row strides; `require_tma_readable` (which `descriptor` calls) raises
naming the tensor where they are missing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


def require_tma_readable(t: torch.Tensor, what: str) -> None:
    """Raise, naming the tensor, unless TMA can read t. The forwards call it on the weights their backward will read
    this way, so that bad shapes fail before any work is done."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
        raise ValueError(f"{what} {tuple(t.shape)} {t.dtype} with strides {t.stride()}: the MoE backward reads it "
                         "through TMA, which needs a 16-byte aligned start, a contiguous last dim and rows whose "
                         "length in bytes is a multiple of 16 (bf16 / fp16: a multiple of 8 elements)")


def descriptor(t: torch.Tensor, block_shape: list[int], what: str) -> TensorDescriptor:
    """A TMA descriptor over t that loads blocks of block_shape."""
    require_tma_readable(t, what)
    return TensorDescriptor.from_tensor(t, block_shape)


@triton.jit
def transposed_weight_tile(w_desc, expert, n0, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w[expert]^T [k : k + BLOCK_K, n0 : n0 + BLOCK_N] from stacked weights w [experts, N, K] (descriptor block
    [1, BLOCK_N, BLOCK_K]). TMA offsets are 32-bit: int64 table entries are cast."""
    return tl.trans(w_desc.load([expert.to(tl.int32), n0, k]).reshape(BLOCK_N, BLOCK_K))
