"""dist/env.py's choices of device and backend, and its errors for what cannot run (CPU: the GPU cases are
simulated by patching what torch reports)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.env import (_pick_backend, _pick_device, check_rank_0_can_write, init_distributed,
                                  ranks_with_one_hardware_queue)
from world import run_world


def test_auto_picks_the_machine_s_device_and_backend():
    device = _pick_device("auto", 0)
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert _pick_backend("auto", device) == ("nccl" if device.type == "cuda" else "gloo")
    assert _pick_backend("auto", torch.device("cpu")) == "gloo"
    assert _pick_backend("gloo", torch.device("cpu")) == "gloo"


def test_unknown_or_impossible_choices_raise():
    """Named by their config keys (every caller passes trainer.device and comm.backend): "device=cuda" alone did not
    say which override to change (comm.mode is also a device-like switch, model.tp_comm another comm)."""
    with pytest.raises(ValueError, match=r"^trainer.device='tpu': expected auto, cpu, cuda or cuda:<index>$"):
        _pick_device("tpu", 0)
    with pytest.raises(ValueError, match=r"^comm.backend='mpi': expected auto, nccl or gloo$"):
        _pick_backend("mpi", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^comm.backend=nccl needs trainer.device=cuda; use comm.backend=gloo on "
                                         r"the CPU$"):
        _pick_backend("nccl", torch.device("cpu"))


def test_cuda_without_a_gpu_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="^trainer.device=cuda was asked for but torch sees no CUDA device"):
        _pick_device("cuda", 0)


def one_gpu_machine(monkeypatch, count: int = 1) -> list[int]:
    """torch as it looks on a machine with `count` GPUs; returns the indices set_device is called with."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_more_local_ranks_than_gpus_raises_naming_the_rank(monkeypatch):
    one_gpu_machine(monkeypatch)
    with pytest.raises(RuntimeError, match=r"^LOCAL_RANK=1 has no GPU of its own: torch sees 1 CUDA device\(s\); .* "
                                           r"or put them on one GPU with trainer.device=cuda:<index>$"):
        _pick_device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"^trainer.device=cuda:1: torch sees 1 CUDA device\(s\)"):
        _pick_device("cuda:1", 0)
    with pytest.raises(ValueError, match="^trainer.device='cuda:one': expected"):
        _pick_device("cuda:one", 0)


def test_cuda_index_puts_every_local_rank_on_that_gpu(monkeypatch):
    chosen = one_gpu_machine(monkeypatch, count=2)
    assert [_pick_device("cuda:1", r) for r in (0, 1)] == [torch.device("cuda", 1)] * 2
    assert _pick_device("cuda", 0) == torch.device("cuda", 0)
    assert chosen == [1, 1, 0]


def test_ranks_sharing_a_gpu_get_gloo_and_nccl_raises_before_joining(monkeypatch):
    gpu = torch.device("cuda", 0)
    assert _pick_backend("auto", gpu, gpu_shared=True) == "gloo"
    assert _pick_backend("auto", gpu) == "nccl"
    one_gpu_machine(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"^every local rank runs on cuda:0 \(trainer.device=cuda:0\), which NCCL "
                                         r"refuses: use comm.backend=gloo or auto"):
        init_distributed("cuda:0", "nccl")


@pytest.mark.parametrize("device,backend,bound", [("cuda", "nccl", True), ("cuda:0", "gloo", False),
                                                  ("cuda", "gloo", False)])
def test_only_nccl_groups_are_bound_to_the_device(monkeypatch, device, backend, bound):
    """A gloo group bound to a device made dist.new_group fail on a GPU (torch's split path, which gloo lacks)."""
    one_gpu_machine(monkeypatch)
    for name, value in dict(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    env = init_distributed(device, backend)
    assert env.backend == backend
    assert calls[0]["backend"] == backend
    assert calls[0]["device_id"] == (torch.device("cuda", 0) if bound else None)


def test_one_process_without_torchrun_has_no_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = init_distributed("cpu")
    assert (env.rank, env.world_size, env.backend, env.device) == (0, 1, None, torch.device("cpu"))
    assert env.is_main


def test_one_process_checks_the_backend_as_torchrun_would(monkeypatch):
    """Without torchrun there is no group, but the configured backend is checked all the same: a config that fails
    under torchrun fails here too, instead of running without a word."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="comm.backend='mpi'"):
        init_distributed("cpu", "mpi")
    with pytest.raises(ValueError, match="nccl"):
        init_distributed("cpu", "nccl")


def test_the_write_check_leaves_a_file_as_it_found_it(tmp_path):
    """check_rank_0_can_write tries a file without writing it: one there keeps its bytes, a new one is not left
    behind (empty, as if the run wrote it); a directory's parents are made. What cannot be written raises."""
    kept = tmp_path / "kept.json"
    kept.write_text("an earlier run's results")
    check_rank_0_can_write(kept, "kept")
    assert kept.read_text() == "an earlier run's results"
    check_rank_0_can_write(tmp_path / "new.json", "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    check_rank_0_can_write(tmp_path / "a" / "b", "a directory", directory=True)
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())
    with pytest.raises(IsADirectoryError):
        check_rank_0_can_write(tmp_path / "a", "a directory as a file")
    with pytest.raises(FileNotFoundError):  # a file's folder is not made: the bench writes into it as it is
        check_rank_0_can_write(tmp_path / "missing" / "out.json", "out")
    with pytest.raises(NotADirectoryError):
        check_rank_0_can_write(kept / "run", "below a file", directory=True)


def _one_queue_ranks(rank: int, world: int, queue_of_rank_1: str | None) -> None:
    import os
    if rank == 1 and queue_of_rank_1 is not None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = queue_of_rank_1
    else:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    gpu = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cuda", rank), backend="gloo")
    cpu = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    expected = [1] if queue_of_rank_1 in ("1", " 1 ") else []
    assert ranks_with_one_hardware_queue(gpu) == expected, (rank, queue_of_rank_1)  # every rank: the same list
    assert ranks_with_one_hardware_queue(cpu) == []  # no hardware queues to share (and no exchange)


@pytest.mark.parametrize("queue_of_rank_1", [None, "1", " 1 ", "8"])
def test_the_ranks_with_one_hardware_queue_are_known_on_every_rank(queue_of_rank_1):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 on one rank only: every rank learns that rank (the batch thread's input dist
    is then off everywhere: train/loop.py); other values, or none, are not one queue."""
    run_world(2, _one_queue_ranks, queue_of_rank_1)
