"""A grown symmetric buffer (torch's CUDA symmetric memory) is freed once nobody holds it, in worlds of one process
on one GPU and of two on two GPUs (skipped where they are missing). The simulated world's twin:
test_symmetric_workspace.py. Memory is read as the device's free memory, which other processes' allocations move
too: the test needs the GPUs to itself (scripts/gpu_check.sh runs the GPU test files one after another). Two ranks
sharing one GPU get CUDA IPC buffers instead (CudaIpcWorkspace), mapped in every rank as they grow."""

from __future__ import annotations

import gc

import pytest
import torch

from fused_dlrm.dist.symmetric import CudaIpcWorkspace, CudaSymmetricWorkspace, cuda_workspace
from world import ONE_GPU, run_world

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
