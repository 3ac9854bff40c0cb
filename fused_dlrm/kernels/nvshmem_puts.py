"""The nvshmem transport's device side: row puts and epoch signals through torch's NVSHMEM Triton functions
(`torch.distributed._symmetric_memory._nvshmem_triton`), which also reach GPUs on other nodes.

Addresses are this rank's own symmetric addresses; NVSHMEM maps them to the destination PE. Puts are block-wide
collectives (every thread of the program calls them) that return once the source may be reused. A program's puts
are completed (quiet) by every thread before its flags are raised, so a flag never overtakes the data behind it.
Flags and acks are 64-bit here (NVSHMEM's signal words); the waits poll local memory with bounded acquire loops,
as the p2p transport's do (peer_flags.py), rather than NVSHMEM's unbounded signal_wait_until.

Only kernels wrapped by `nvshmem_kernel` may call these functions: wrapping links NVSHMEM's device library,
found on GPU machines whose torch is built with NVSHMEM (the interpreter cannot run them). The nvshmem kernels
are separate functions beside their p2p twins (sharing their device functions), not a constexpr branch of them:
torch's `requires_nvshmem` registers a kernel by name and initialises NVSHMEM in every variant compiled under
that name, which the p2p variants (and the bulk path's lookup) must not get.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from torch.distributed._symmetric_memory import _nvshmem_triton as nvshmem

# NVSHMEM_SIGNAL_SET is 9 (NVSHMEMI_AMO_SIGNAL_SET; ADD is 10). torch's _nvshmem_triton docstring says 0, which
# NVSHMEM's NVLink path treats as an add: flags then grew past every epoch and the waits passed early.
SIGNAL_SET = tl.constexpr(9)


@functools.cache
def nvshmem_kernel(jit_function):
    """The launchable form of a kernel that calls NVSHMEM device functions (built on first use)."""
    return nvshmem.requires_nvshmem(jit_function)


@triton.jit
def put_rows(dst, dst_stride, src, src_stride, row_bytes, n_rows, pe):
    """Put rows src + r * src_stride -> dst + r * dst_stride (element pointers, row_bytes each) for r < n_rows."""
    tl.debug_barrier()  # what this program just stored into src is visible to every thread of the block
    r = 0
    while r < n_rows:
        nvshmem.putmem_block_extern_wrapper((dst + r * dst_stride).to(tl.int64), (src + r * src_stride).to(tl.int64),
                                            row_bytes.to(tl.int64), pe)
        r += 1
    tl.debug_barrier()  # no thread refills src while another may still be putting it


@triton.jit
def set_flag(flag, value, rank, pe):
    """flag (a 64-bit word, symmetric) := value in PE `pe`; the local one with a release store."""
    value = value + tl.zeros([], tl.int64)  # epochs may arrive as constexpr (Triton specialises 1)
    if pe == rank:
        tl.atomic_xchg(flag, value, sem="release", scope="sys")
    else:
        nvshmem.signal_op(flag.to(tl.int64), value, SIGNAL_SET, pe)


@triton.jit
def signal_ready_nvshmem(ready_ptr, slot, epoch, rank, WORLD: tl.constexpr):
    """After this program's puts and stores: raise flag `slot` of `epoch` in every rank."""
    nvshmem.quiet()  # this thread's puts are delivered ...
    tl.debug_barrier()  # ... and so are every other thread's
    for peer in tl.static_range(WORLD):
        set_flag(ready_ptr + slot, epoch, rank, peer)
