"""Run a function on a world of processes (gloo on the CPU, NCCL on GPUs, or gloo with ranks sharing one GPU)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import interpreter_floats  # noqa: F401  (a rank imports this module, not conftest: its kernels' float arguments)

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
ONE_GPU = "one_gpu"  # run_world's backend for ranks sharing GPU 0: gloo collectives, p2p buffers by CUDA IPC

# A two-rank GPU test's worlds: two GPUs under NCCL, and two ranks sharing one GPU, which checks the world-2 paths'
# results on a one-GPU machine (dist/symmetric.CudaIpcWorkspace; the GPU time-slices the ranks, so never timings).
TWO_RANK_BACKENDS = [
    pytest.param("nccl", marks=TWO_GPUS),
    pytest.param(ONE_GPU, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
]


# Without a GPU, ranks are forked from a server that imported these once per session: spawned ranks each imported
# torch, torchrec, fbgemm and the library again (~13 s of CPU per rank, most of a small world's time on CI's 2
# cores). With one, they spawn: a process forked after CUDA's driver was initialised (which an import may do)
# cannot use CUDA.
_PRELOAD = ["fused_dlrm.train.loop", "moe.train"]


def _worker(rank: int, world_size: int, store_path: str, backend: str, fn, args, environ: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank starts with the fork server's environment: the caller's, as spawned ones have
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    elif backend == ONE_GPU:
        torch.cuda.set_device(0)
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            device_id=device_id)
    # No destroy after a failure: with NCCL it waits for the peers, which may be inside a collective that this
    # rank will never join (a hang instead of the failure); mp.spawn stops them once this process has exited.
    fn(rank, world_size, *args)
    gc.collect()  # free DDP reducers (reference cycles) while the process group still exists
    dist.destroy_process_group()


def run_world(world_size: int, fn, *args, backend: str = "gloo", timeout: float | None = None) -> None:
    """Call fn(rank, world_size, *args) in `world_size` fresh processes; a failure in any of them fails the caller.
    backend="nccl" gives rank r the GPU r; backend=ONE_GPU puts every rank on GPU 0 (gloo collectives).
    timeout: seconds after which the ranks still running are killed and the caller fails (a test of what must not
    hang: a rank left waiting in a collective would otherwise wait for the backend's own timeout, minutes).

    `fn` must be importable (a module-level function): the processes are spawned, or forked from a server that
    has not imported the caller's module.
    """
    with tempfile.TemporaryDirectory() as tmp:
        start_method = "spawn" if torch.cuda.is_available() else "forkserver"
        if start_method == "forkserver":
            mp.set_forkserver_preload(_PRELOAD)
        ranks = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), backend, fn, args,
                                                  dict(os.environ)),
                                   nprocs=world_size, join=False, start_method=start_method)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ranks.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(ranks.processes) if p.is_alive()]
                for p in ranks.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(f"rank(s) {running} of {world_size} still ran after {timeout} s (a hang?)")


def run_torchrun(args: list[str], nproc: int = 2, timeout: int = 600,
                 program: tuple[str, ...] = ("train.py",)) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=<nproc> --standalone <program> <args>` from the repository root; fails on error.
    program: a script, or ("-m", module)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *program,
           *args]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
