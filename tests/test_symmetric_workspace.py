"""Symmetric workspaces (fused_dlrm/dist/symmetric.py): buffers shared by name, grown on demand, and freed once
they grew and nobody holds them, in the simulated world (torch's CUDA symmetric memory: the _gpu twin); and which
ranks count as sharing a GPU (cuda_workspace's choice of CUDA IPC), with the GPUs' identities patched."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import SimulatedWorld, ranks_share_a_gpu
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


def _sharing(rank: int, world: int, gpus: list[str], shared: bool) -> None:
    torch.cuda.current_device = lambda: 0  # this rank's process's torch only
    torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=gpus[rank])
    assert ranks_share_a_gpu(dist.group.WORLD) is shared


@pytest.mark.parametrize("gpus,shared", [(["GPU-a", "GPU-b", "GPU-c"], False), (["GPU-a", "GPU-b", "GPU-a"], True)])
def test_ranks_share_a_gpu_when_two_have_one_uuid(gpus, shared):
    run_world(len(gpus), _sharing, gpus, shared)
