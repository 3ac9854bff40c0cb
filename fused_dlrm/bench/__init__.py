"""Benchmarks (run under torchrun on GPUs): `python -m fused_dlrm.bench embedding`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fused_dlrm.dist import DistEnv


def init_gpu_world(command: str) -> DistEnv:
    """A GPU benchmark's process group: NCCL, this rank on GPU LOCAL_RANK (the world it returns: its JSON's
    `environment`, report/render.py). Without CUDA GPUs, an exit that says so (torch's own error there names a
    missing `_cuda_setDevice`)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{command} times GPU kernels against NCCL: it needs CUDA GPUs (under torchrun, one a rank)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, "nccl")


def named_twice(names: list) -> object | None:
    """The first of `names` given again (a bench's variants, sections or configs: each is run, and its results
    kept, once), or None."""
    seen = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None
