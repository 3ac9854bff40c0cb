"""Run a function on a world of gloo processes on the CPU, as pytest tests need it."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, fn, *args) -> None:
    """Call fn(rank, world_size, *args) in `world_size` fresh processes; a failure in any of them fails the caller.

    `fn` must be importable (a module-level function) since the processes are spawned, not forked.
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), fn, args), nprocs=world_size, join=True)
