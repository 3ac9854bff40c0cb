"""Symmetric workspaces (fused_dlrm/dist/symmetric.py): buffers shared by name, grown on demand, and freed once
they grew and nobody holds them, in the simulated world (torch's CUDA symmetric memory: the _gpu twin); the ranks'
allocations compared before each one (in the store of a gloo world; by order in the simulated world, as GPUs pair
them); and which ranks count as sharing a GPU (cuda_workspace's choice of CUDA IPC), with the GPUs' identities
patched."""

from __future__ import annotations

import gc
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import (AllocationMismatch, AllocationRefused, AllocationRequest, AllocationTimeout,
                                       SimulatedWorld, agree_on_allocation, ranks_share_a_gpu)
from world import run_world


def test_ranks_share_a_buffer_by_name_and_a_grown_one_is_freed_once_no_rank_holds_it():
    world = SimulatedWorld(2)
    ranks = world.workspaces()
    first = [ws.buffer("rows", 100, torch.float32) for ws in ranks]
    assert torch.equal(first[0].peer_ptrs, first[1].peer_ptrs)
    assert first[1].peer_ptrs[0] == first[0].local.data_ptr()
    first[0].local.fill_(3.0)
    assert ranks[1].peer_tensors(first[1])[0].eq(3.0).all()
    old = [weakref.ref(t) for t in first[0].handle]
    del first

    grown = ranks[0].buffer("rows", 1000, torch.float32)
    assert grown.local.numel() == 1000 and grown.local.eq(0).all()
    assert ranks[0].buffer("rows", 50, torch.float32) is grown  # never shrinks
    gc.collect()
    assert all(ref() is not None for ref in old), "rank 1 still holds the old buffer: it must stay alive"
    assert ranks[1].buffer("rows", 1000, torch.float32).local is grown.handle[1]
    gc.collect()
    assert all(ref() is None for ref in old), "the old buffer outlived every rank's hold on it"

    ranks[0].buffer("flags", 4, torch.int32)
    with pytest.raises(RuntimeError, match="cannot grow"):
        ranks[0].buffer("flags", 8, torch.int32)


def test_simulated_ranks_pair_buffers_by_the_order_of_their_allocations_as_gpus_do():
    """Rank 1 allocating its buffers in another order would read rank 0's "b" as its "a" on GPUs: refused at its
    first allocation, as is another dtype. Sizes may differ (GPUs take the largest) where the first rank's is the
    largest; a larger one later cannot reach the first rank's buffer, so it is refused too."""
    world = SimulatedWorld(2)
    ranks = world.workspaces()
    ranks[0].buffer("b", 10, torch.float32)
    ranks[0].buffer("a", 10, torch.float32)
    with pytest.raises(AllocationMismatch, match=r"rank 1: symmetric allocation #1 of the simulated world: rank 0 "
                                                 r"asked for 'b' of 10 x float32, rank 1 for 'a' of 10 x float32"):
        ranks[1].buffer("a", 10, torch.float32)
    with pytest.raises(AllocationMismatch, match=r"#1 .* rank 1 for 'b' of 10 x int32"):
        ranks[1].buffer("b", 10, torch.int32)

    world = SimulatedWorld(2)
    ranks = world.workspaces()
    big, small = ranks[0].buffer("rows", 100, torch.float32), ranks[1].buffer("rows", 40, torch.float32)
    assert small.handle is big.handle and small.local.numel() == 100
    ranks[0].buffer("cols", 10, torch.float32)
    with pytest.raises(AllocationMismatch, match="#2 .* rank 1 for 'cols' of 20 x float32: GPUs give every rank"):
        ranks[1].buffer("cols", 20, torch.float32)


def test_simulated_rank_using_a_buffer_a_peer_grew_without_it_is_refused():
    """Rank 0's call of a larger shape grows "rows"; rank 1's call fits its buffer, so on GPUs it never joins the
    allocation and rank 0 waits in it: refused when rank 1 uses "rows", naming both."""
    ranks = SimulatedWorld(2).workspaces()
    for ws in ranks:
        ws.buffer("rows", 100, torch.float32)
    ranks[0].buffer("rows", 200, torch.float32)
    with pytest.raises(AllocationTimeout, match=r"rank 1: rank 0 grew 'rows' \(symmetric allocation #2 of the "
                                                r"simulated world: 'rows' of 200 x float32\) but rank 1 asked for "
                                                r"'rows' of 50 x float32, which its buffer of 100 holds"):
        ranks[1].buffer("rows", 50, torch.float32)


def _allocation_requests(rank: int, world_size: int) -> None:
    group, last = dist.group.WORLD, world_size - 1
    request = lambda name, numel=10, dtype=torch.float32: AllocationRequest(name, numel, dtype)
    # Sizes may differ by rank (the nvshmem lookup's scratch): every rank allocates the largest.
    assert agree_on_allocation(group, request("rows", 10 * (rank + 1)), 5.0) == 10 * world_size
    # The last rank allocates another buffer, or another dtype: every rank raises, naming every rank's request.
    every = ", ".join(f"rank {r} 'a' of 10 x float32" for r in range(last))
    with pytest.raises(AllocationMismatch, match=rf"rank {rank}: symmetric allocation #2 of process group "
                                                 rf"{group.group_name}: the ranks asked for different buffers: "
                                                 rf"{every}, rank {last} 'b' of 10 x float32 \(every rank"):
        agree_on_allocation(group, request("b" if rank == last else "a"), 5.0)
    with pytest.raises(AllocationMismatch, match=rf"#3 .* rank {last} 'c' of 10 x int32"):
        agree_on_allocation(group, request("c", dtype=torch.int32 if rank == last else torch.float32), 5.0)
    # All but the last rank grow "rows" (a call of a larger shape on them only): they name the last rank within
    # the timeout; the last rank's next allocation, later, raises it too instead of entering an allocation alone.
    if rank != last:
        start = time.monotonic()
        with pytest.raises(AllocationTimeout, match=rf"rank {rank}: symmetric allocation #4 .*: rank\(s\) \[{last}\] "
                                                    r"did not ask for it within 1 s; rank 0 'rows' of 50 x float32"):
            agree_on_allocation(group, request("rows", 50), 1.0)
        assert time.monotonic() - start < 10
        dist.barrier()
    else:
        dist.barrier()
        with pytest.raises(AllocationTimeout, match=rf"\[{last}\] did not .* \(this rank, asking for 'other' of 10 x "
                                                    r"float32, came after the others"):
            agree_on_allocation(group, request("other"), 1.0)
    # The last rank refuses the call that would allocate "d" (its input), in that allocation's place: every rank
    # raises, naming it and why, and none allocates.
    refusal = "its x is 3-D" if rank == last else ""
    with pytest.raises(AllocationRefused, match=rf"^rank {rank}: symmetric allocation #5 of process group "
                                                rf"{group.group_name}: rank {last} refused its call, which would ask "
                                                r"for 'd' of 10 x float32: its x is 3-D$"):
        agree_on_allocation(group, AllocationRequest("d", 10, torch.float32, refusal), 5.0)
    assert agree_on_allocation(group, request("next", 7), 5.0) == 7  # and the ranks go on in step


def test_ranks_compare_their_allocations_and_name_a_rank_that_does_not_ask():
    run_world(3, _allocation_requests, timeout=120)


def _sharing(rank: int, world: int, gpus: list[str], shared: bool) -> None:
    torch.cuda.current_device = lambda: 0  # this rank's process's torch only
    torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=gpus[rank])
    assert ranks_share_a_gpu(dist.group.WORLD) is shared


@pytest.mark.parametrize("gpus,shared", [(["GPU-a", "GPU-b", "GPU-c"], False), (["GPU-a", "GPU-b", "GPU-a"], True)])
def test_ranks_share_a_gpu_when_two_have_one_uuid(gpus, shared):
    run_world(len(gpus), _sharing, gpus, shared)
