"""A grown symmetric buffer (torch's CUDA symmetric memory) is freed once nobody holds it, in worlds of one process
on one GPU and of two on two GPUs (skipped where they are missing). The simulated world's twin:
test_symmetric_workspace.py. Memory is read as the device's free memory, which other processes' allocations move
too: the test needs the GPUs to itself (scripts/gpu_check.sh runs the GPU test files one after another). Two ranks
sharing one GPU get CUDA IPC buffers instead (CudaIpcWorkspace), mapped in every rank as they grow. Both compare the
ranks' requests before allocating: a mismatch or a rank that does not ask is an error, not a hang."""

from __future__ import annotations

import gc

import pytest
import torch

from fused_dlrm.dist.symmetric import (AllocationMismatch, AllocationTimeout, CudaIpcWorkspace, CudaSymmetricWorkspace,
                                       cuda_workspace)
from world import ONE_GPU, TWO_RANK_BACKENDS, run_world

GIB = 2**30


def _in_use(free_before: int) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the checks' temporaries, cached by torch's allocator
    return (free_before - torch.cuda.mem_get_info()[0]) / GIB


def _grow_and_free(rank: int, world_size: int) -> None:
    ws = CudaSymmetricWorkspace()
    # NCCL's and symmetric memory's one-time allocations (communicator, rendezvous) go before the baseline
    ws.buffer("warm-up", 1024, torch.float32)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    for size in (1, 2, 3):  # 6 GiB on this GPU if the grown buffers were kept
        ws.buffer("rows", size * GIB // 4, torch.float32).local.fill_(float(size))
    used = _in_use(free_before)
    assert used < 3.5, f"rank {rank}: {used:.2f} GiB in use after growing to 3 GiB: the grown buffers were kept"

    held = ws.buffer("rows", 1, torch.float32)  # a caller's hold keeps the 3 GiB buffer alive across a growth
    grown = ws.buffer("rows", GIB, torch.float32)
    assert held.local.eq(3.0).all()
    assert _in_use(free_before) > 6.5
    # The new buffer is mapped in every rank: each rank writes its rank into the next one's, and reads its own.
    torch.distributed.barrier()
    ws.peer_tensors(grown)[(rank + 1) % world_size][:1024].fill_(float(rank))
    torch.cuda.synchronize()
    torch.distributed.barrier()
    assert grown.local[:1024].eq(float((rank - 1) % world_size)).all()
    del held
    used = _in_use(free_before)
    assert used < 4.5, f"rank {rank}: {used:.2f} GiB in use once the old buffer was let go"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_grown_buffer_is_freed(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPU(s)")
    run_world(world_size, _grow_and_free, backend="nccl")


def _shared_by_ipc(rank: int, world_size: int) -> None:
    ws = cuda_workspace()
    assert isinstance(ws, CudaIpcWorkspace)
    for size in (1000, 300_000):  # the grown buffer is mapped in every rank too
        buf = ws.buffer("rows", size, torch.float32)
        peers = ws.peer_tensors(buf)
        assert buf.peer_ptrs.tolist() == [t.data_ptr() for t in peers]
        assert peers[rank].data_ptr() == buf.local.data_ptr()
        assert buf.local.eq(0).all()
        torch.distributed.barrier()
        peers[(rank + 1) % world_size].fill_(float(size + rank))
        torch.cuda.synchronize()
        torch.distributed.barrier()
        assert buf.local.eq(float(size + (rank - 1) % world_size)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ranks_sharing_a_gpu_share_buffers_by_ipc():
    run_world(2, _shared_by_ipc, backend=ONE_GPU)


def _allocations_compared(rank: int, world_size: int) -> None:
    ws = cuda_workspace(allocation_timeout_s=2.0)
    ws.buffer("rows", 1000 * (rank + 1), torch.float32)  # sizes may differ: every rank gets the largest
    assert ws.buffer("rows", 1, torch.float32).local.numel() == 1000 * world_size
    with pytest.raises(AllocationMismatch, match="rank 0 'a' of 10 x float32, rank 1 'b' of 10 x float32"):
        ws.buffer("ab"[rank], 10, torch.float32)  # allocated in another order: rank 1's "b" would be rank 0's "a"
    if rank == 0:
        with pytest.raises(AllocationTimeout, match=r"rank\(s\) \[1\] did not ask for it within 2 s"):
            ws.buffer("rows", 10_000, torch.float32)  # a larger shape on rank 0 only: rank 1 never joins
        torch.distributed.barrier()
    else:
        ws.buffer("rows", 10, torch.float32)  # fits: no allocation
        torch.distributed.barrier()
        with pytest.raises(AllocationTimeout, match="this rank, asking for 'cols' of 10 x float32, came after"):
            ws.buffer("cols", 10, torch.float32)
    # The ranks go on in step: the next buffer is shared (each rank writes into the next one's).
    buf = ws.buffer("next", 1024, torch.float32)
    torch.distributed.barrier()
    ws.peer_tensors(buf)[(rank + 1) % world_size].fill_(float(rank + 1))
    torch.cuda.synchronize()
    torch.distributed.barrier()
    assert buf.local.eq(float((rank - 1) % world_size + 1)).all()


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_allocations_compared_across_ranks_instead_of_hanging(backend):
    run_world(2, _allocations_compared, backend=backend, timeout=300)
