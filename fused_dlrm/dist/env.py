"""Initialise torch.distributed from the torchrun environment and pick device and backend.

One process started without torchrun gets a world of one and no process group: every collective in the project
is the identity there, so the same code runs in a notebook, under pytest and under torchrun.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: one process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_device_name(key: str, device: str) -> None:
    """A config's device (trainer.device, data.<split>.device): auto, cpu, cuda or cuda:<index>, refused by its key
    (torch's own error names no key)."""
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"{key}={device!r}: expected auto, cpu, cuda or cuda:<index>")


def _pick_device(device: str, local_rank: int) -> torch.device:
    """trainer.device: auto | cpu | cuda (the GPU of this LOCAL_RANK) | cuda:N (GPU N, for every rank of the node)."""
    check_device_name("trainer.device", device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"trainer.device={device} was asked for but torch sees no CUDA device")
    index, count = (local_rank if device == "cuda" else int(device[5:])), torch.cuda.device_count()
    if index >= count:  # else set_device fails with "invalid device ordinal"
        who = f"LOCAL_RANK={local_rank} has no GPU of its own" if device == "cuda" else f"trainer.device={device}"
        raise RuntimeError(f"{who}: torch sees {count} CUDA device(s); start at most that many processes per node "
                           "(torchrun --nproc_per_node), or put them on one GPU with trainer.device=cuda:<index>")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _pick_backend(backend: str, device: torch.device, gpu_shared: bool = False) -> str:
    """comm.backend for trainer.device's `device`; gpu_shared: the node's ranks all run on `device`
    (trainer.device=cuda:N), which NCCL refuses."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" and not gpu_shared else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("comm.backend=nccl needs trainer.device=cuda; use comm.backend=gloo on the CPU")
    if backend == "nccl" and gpu_shared:
        raise ValueError(f"every local rank runs on {device} (trainer.device={device}), which NCCL refuses: use "
                         "comm.backend=gloo or auto (the fused operators then share memory by CUDA IPC; the GPU "
                         "time-slices the ranks)")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"comm.backend={backend!r}: expected auto, nccl or gloo")
    return backend


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0,
                     tf32: bool = False) -> DistEnv:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or none.
    device, backend: the config's trainer.device and comm.backend (their errors name those keys); tf32: fp32 GEMMs
    and convolutions on GPUs may use TF32 tensor cores (the CPU is not affected)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    gpu_shared = device.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    chosen = _pick_backend(backend, dev, gpu_shared)  # checked in one process too: the same config under torchrun
    if "WORLD_SIZE" not in os.environ:
        return DistEnv(rank=0, world_size=1, local_rank=0, device=dev, backend=None)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=chosen,
            timeout=datetime.timedelta(seconds=timeout_s),
            # NCCL only: a device bound to a gloo group sends new_group down torch's split path, which gloo lacks
            # (torch 2.11: a group leaving this rank out, e.g. model.tp_size's groups, raised AttributeError).
            device_id=dev if chosen == "nccl" else None,
        )
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks but WORLD_SIZE={world_size}")
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=chosen)


def input_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for the input side of training (batches made, copied and distributed ahead of their step), at high
    priority (-1, as torchrec's TrainPipelineSparseDist makes its copy and data-dist streams): its small kernels and
    copies are scheduled ahead of the step's queued blocks, so the batch thread's waits on them (the input dist's
    header) do not last a step's kernels (docs/benchmarks.md, 2026-12-02, fifty-sixth session). The input dist's
    collectives are synchronous (async_op=False): NCCL runs them on this stream too (only async ones get a stream
    of NCCL's own), at its priority."""
    return torch.cuda.Stream(device, priority=-1)


def ranks_with_one_hardware_queue(env: DistEnv) -> list[int]:
    """The ranks whose GPU runs every stream's kernels through one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1,
    Megatron's setting), the same list on every rank (a host exchange); [] off GPUs. There kernels start in the
    order the host enqueued them, whatever their streams: two threads enqueueing collectives (or waits on peers)
    can order them differently on two ranks, and each rank's then waits behind the one that waits for the other's."""
    if env.device.type != "cuda":
        return []
    one_queue = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"
    return [rank for rank, one in enumerate(of_every_rank(one_queue)) if one]


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over all ranks (nothing to do in one process)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def of_every_rank(value) -> list:
    """Every rank's `value` (a picklable object), in rank order; [value] in one process."""
    if not dist.is_initialized():
        return [value]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def check_same_on_every_rank(value: str, what: str, mine: str, must: str) -> None:
    """Raise on every rank unless every rank's `value` (its description: sizes, a digest) is rank 0's, naming the
    first rank that differs: "rank r: {what} between ranks: rank o's ..., rank 0's ... (this rank's: {mine});
    {must}". For what ranks on other nodes each read or build for themselves (data files, a corpus)."""
    every = of_every_rank(value)
    for other, theirs in enumerate(every):
        if theirs != every[0]:
            raise ValueError(f"rank {dist.get_rank()}: {what} between ranks: rank {other}'s {theirs}, rank 0's "
                             f"{every[0]} (this rank's: {mine}); {must}")


class CallMismatch(ValueError):
    """Ranks made one collective call with different arguments (sizes, dtypes, ...): bad input, raised on every
    rank (the fused kernels' PeerCallMismatch is one)."""


def check_same_call(signature: list[int], group: dist.ProcessGroup | None, describe: Callable[[list[int]], str],
                    what: str) -> None:
    """Raise CallMismatch on every rank of `group` unless every rank passes the same `signature` (as many ints on
    every rank): all-gathered in one small collective of CPU tensors, so every rank sees the same table and names the
    first peer whose signature differs from its own, both in `describe`'s words. Before the op's own collectives:
    gloo's abort the process on messages of other sizes or dtypes, NCCL's hang or mix data up. `group` takes CPU
    tensors: a gloo group (beside an NCCL group, its `gloo_side_group`: no device sync)."""
    mine = torch.tensor([signature], dtype=torch.int64)
    everyone = mine.new_empty((dist.get_world_size(group), mine.shape[1]))
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rank, signatures = dist.get_rank(group), everyone.tolist()
    for peer, theirs in enumerate(signatures):
        if theirs != signatures[rank]:
            raise CallMismatch(f"{what}: rank {rank}: peer {peer} called it with {describe(theirs)}; this rank with "
                               f"{describe(signatures[rank])} (every rank must make the same calls in the same order)")


_GLOO_SIDE_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def gloo_side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group of `group`'s ranks, for small collectives of CPU tensors beside a group whose backend takes none
    (NCCL): `check_same_call` there is a host-side exchange, with no wait for the device. Made at the first call for
    a set of ranks, by those ranks alone (each must make that call), then reused: one per set of ranks (torch names
    a group made so by its ranks). Ranks are numbered in ascending order, as new_group numbers `group`'s by default."""
    group = group or dist.group.WORLD
    ranks = sorted(dist.get_process_group_ranks(group))
    key = (dist.group.WORLD, tuple(ranks))  # a process group initialised again makes new side groups
    if key not in _GLOO_SIDE_GROUPS:
        _GLOO_SIDE_GROUPS[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _GLOO_SIDE_GROUPS[key]


def problem_text(problem: BaseException | None) -> str | None:
    """An error as `raise_on_every_rank` exchanges it ("KeyError: ..."; None: none)."""
    return None if problem is None else f"{type(problem).__name__}: {problem}"


def raise_on_every_rank(problem: BaseException | None, what: str, problems: list[str | None] | None = None) -> None:
    """Call on every rank with the error this rank met (None: none): if any rank met one, every rank raises, this
    one its own error, the others a ValueError "rank(s) [...] <what>: <the first one's error>". A rank raising
    alone before a collective (a file its node lacks) would leave its peers waiting in that collective.
    problems: every rank's `problem_text`, where the caller exchanged them already (with values of its own)."""
    if problems is None:
        problems = of_every_rank(problem_text(problem))
    if problem is not None:
        raise problem
    bad = [rank for rank, text in enumerate(problems) if text]
    if bad:
        raise ValueError(f"rank {dist.get_rank()}: rank(s) {bad} {what}: {problems[bad[0]]}")


def write_problem(path: Path, directory: bool = False) -> OSError | None:
    """The error this process meets writing `path` (None: none): a file (opened to append, which keeps one there,
    and removed if this made it), or with `directory` a directory (made with its parents, a temporary file tried in
    it)."""
    try:
        if directory:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            made = not path.exists()
            with open(path, "a"):
                pass
            if made:
                path.unlink()
    except OSError as error:
        return error
    return None


def check_rank_0_can_write(path: Path, what: str, directory: bool = False) -> None:
    """Call on every rank before a run whose results rank 0 writes at its end (minutes on GPUs): rank 0 tries now
    to write `path` (`write_problem`). Where it cannot, every rank raises here (`raise_on_every_rank`: the others a
    ValueError naming rank 0's error), not rank 0 alone at the end."""
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        problem = write_problem(path, directory)
    raise_on_every_rank(problem, f"cannot write {what}")
