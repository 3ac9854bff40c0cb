"""Operands read through TMA tensor descriptors (Hopper's tensor memory accelerator): the checks a tensor must
pass, descriptors built on the host, and the fence that lets TMA read what peers stored.

Why TMA: a descriptor load brings a whole tile into shared memory with one instruction and no per-element address
or mask arithmetic, and zero-fills a block's parts outside the tensor (k tails and partial tiles need no masks).
Descriptors are built on the host (no device scratch allocator to install). TMA needs a 16-byte aligned start, a
contiguous last dim and 16-byte aligned strides; `require_tma_readable` (which `descriptor` calls) raises naming
the tensor where they are missing.

TMA reads go through the async proxy. Rows that a peer stored and that a kernel acquired through a flag (a load
in the generic proxy) are ordered before its TMA reads only by `async_proxy_fence` between the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_problem(t: torch.Tensor, what: str) -> str | None:
    """Why TMA cannot read t, naming the tensor; None if it can."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
        return (f"{what} {tuple(t.shape)} {t.dtype} with strides {t.stride()}: read through TMA, which needs a "
                "16-byte aligned start, a contiguous last dim and rows whose length in bytes is a multiple of 16 "
                "(bf16 / fp16: a multiple of 8 elements)")
    return None


def require_tma_readable(t: torch.Tensor, what: str) -> None:
    """Raise `tma_problem` where there is one (callers check before any work is done)."""
    problem = tma_problem(t, what)
    if problem is not None:
        raise ValueError(problem)


def tma_readable(t: torch.Tensor) -> torch.Tensor:
    """t, or where it is not contiguous or starts off 16 bytes (a view into a larger buffer) a contiguous copy
    (fresh allocations are aligned): for an operand that is copied rather than refused. Its rows' length is the
    caller's to check."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def descriptor(t: torch.Tensor, block_shape: list[int], what: str) -> TensorDescriptor:
    """A TMA descriptor over t that loads blocks of block_shape."""
    require_tma_readable(t, what)
    return TensorDescriptor.from_tensor(t, block_shape)


@triton.jit
def async_proxy_fence(ON_GPU: tl.constexpr):
    """Order this thread's earlier generic-proxy accesses (a flag's acquire) before its later TMA reads of global
    memory. The interpreter has no proxies (and no inline PTX): ON_GPU=False makes it a no-op there."""
    if ON_GPU:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
