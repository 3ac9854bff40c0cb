"""Symmetric memory for fused operators: buffers every rank can store into, ready flags, and step epochs.

One `SymmetricWorkspace` per fused operator and rank owns all of its communication memory; kernels receive only
int64 tables of peer base addresses (`peer_ptrs`) and convert them with `tl.load(ptrs + peer).to(pointer_type)`.

Implementations of one interface (`transport` says which kernels a fused operator launches):
- `CudaSymmetricWorkspace` ("p2p"): torch SymmetricMemory (`_symmetric_memory.empty` + `rendezvous`), NVLink peers.
- `CudaIpcWorkspace` (also "p2p"): plain device tensors shared by CUDA IPC handles, for ranks that share one GPU,
  which SymmetricMemory refuses: a one-GPU machine runs world-2 paths with two processes (gloo collectives; the
  GPU time-slices them, so it checks results, not speed). `cuda_workspace` picks between the two.
- `NvshmemSymmetricWorkspace` ("nvshmem"): the same API on torch's NVSHMEM backend; kernels put through NVSHMEM
  (kernels/nvshmem_puts.py) at this rank's own symmetric addresses, which also reaches other nodes.
- `SimulatedWorkspace`: a world of ranks simulated in one process (one tensor per rank), so the kernels' logic
  runs under TRITON_INTERPRET=1 in CI; kernels of all ranks are launched in turn, producers first. On one GPU the
  same world times a kernel's phases one by one (peer stores then land in local memory, not over NVLink).

Buffers are allocated on first use and grown (never shrunk) when a larger size is asked for. Every rank must ask
for the same names in the same order: allocation is collective on GPUs, pairs the ranks' buffers by their order, and
takes the largest size asked for. So before each allocation the ranks compare their requests through the process
group's store (`agree_on_allocation`, a few store round trips; never on a call that allocates nothing): other names
or dtypes raise AllocationMismatch on every rank, and ranks that do not ask within `allocation_timeout_s` (a call
that makes only some ranks allocate or grow a buffer, which would leave them waiting in the allocation forever) are
named by AllocationTimeout. A rank whose refused call would have made the allocation its peers' calls make takes
part in it with its refusal (`refuse_allocation`): every rank raises AllocationRefused naming it and why, and no
buffer is made. The simulated world pairs by order too and raises the same errors where GPUs would
fail (an allocation unlike the first rank's of that number; a rank using a buffer that a peer grew without it). A
grown buffer's old memory is released once nothing holds its PeerBuffer any more (torch synchronises the device
before it unmaps symmetric memory, and a peer's mapping keeps the memory alive for that peer until it lets go);
the nvshmem workspace keeps every buffer instead (NVSHMEM frees collectively).
Each exchange numbers its calls (`next_epoch`, from 1) up to MAX_EPOCH, int32's last value: the call after it is
refused on every rank alike (`next_epoch_after`, which the quantized all-reduce's own count shares; an op that counts
a call at its end checks it before its launches: `upcoming_epoch`).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fused_dlrm.dist.env import CallMismatch

log = logging.getLogger(__name__)

# How long a rank waits for its peers' requests before a collective allocation, by default (comm.allocation_timeout_s
# sets it): as long as the flags' waits (kernels/peer_flags.DEFAULT_SPIN_LIMIT, ~54 s), past a peer's kernel compiles.
ALLOCATION_TIMEOUT_S = 60.0


def check_allocation_timeout(seconds: object) -> float:
    """An allocation bound (comm.allocation_timeout_s) as a float; ValueError unless a positive, finite number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"allocation_timeout_s={seconds!r} (comm.allocation_timeout_s): expected a positive, finite "
                         "number of seconds, how long a rank waits for its peers at a symmetric allocation")
    return float(seconds)


@dataclass(frozen=True)
class AllocationRequest:
    name: str
    numel: int
    dtype: torch.dtype
    refusal: str = ""  # why the rank refuses the call that would make it (`_Workspace.refuse_allocation`)

    def __str__(self) -> str:
        return f"{self.name!r} of {self.numel} x {str(self.dtype).removeprefix('torch.')}"

    def encode(self) -> str:
        return json.dumps([self.name, self.numel, str(self.dtype).removeprefix("torch."), self.refusal])

    @staticmethod
    def decode(text: bytes | str) -> "AllocationRequest":
        name, numel, dtype, refusal = json.loads(text)
        return AllocationRequest(name, numel, getattr(torch, dtype), refusal)


class AllocationMismatch(CallMismatch):
    """The ranks' n-th collective allocations asked for different buffers: GPUs would pair them (one rank's buffer
    read as another's) or leave a rank waiting; raised on every rank."""


class AllocationRefused(CallMismatch):
    """A rank refused the call that would make a collective allocation (its input), in that allocation's place
    (`_Workspace.refuse_allocation`): no buffer is made; raised on every rank."""


def refused_allocation(rank: int, what: str, refusing: int, request: AllocationRequest) -> AllocationRefused:
    """The error of rank `rank` at allocation `what`, which rank `refusing` refused (`request`: its refusal)."""
    return AllocationRefused(f"rank {rank}: {what}: rank {refusing} refused its call, which would ask for {request}: "
                             f"{request.refusal}")


class AllocationTimeout(TimeoutError):
    """Some ranks did not ask for a collective allocation in time (the others would wait in it forever)."""


_allocations: dict[str, int] = {}  # by process group name: how many collective allocations this process made in it


def agree_on_allocation(group: dist.ProcessGroup, request: AllocationRequest, timeout_s: float) -> int:
    """Before a collective allocation in `group`: every rank posts its request in the group's store and waits, at
    most `timeout_s`, for the others'; returns the largest numel asked for (some sizes depend on the rank, and
    NVSHMEM needs one size on every rank). Raises AllocationMismatch on every rank unless all ask for one name and
    dtype, AllocationRefused where a rank refused its call instead (`_Workspace.refuse_allocation`), and
    AllocationTimeout naming the ranks that did not ask in time (on every rank that did, and on a
    latecomer). Costs a few round trips to the store (a ms); allocations are rare (first use, growth)."""
    store = dist.distributed_c10d._get_process_group_store(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    number = _allocations[group.group_name] = _allocations.get(group.group_name, 0) + 1
    what = f"symmetric allocation #{number} of process group {group.group_name}"
    prefix = f"fused_dlrm/symmetric/{number}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], request.encode())
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        missing = []
    except RuntimeError:  # DistStoreError: timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    # The first rank to decide decides for all (compare_set writes a missing key only), so a rank arriving just as
    # another gives up learns that it did, instead of entering an allocation the others have left.
    missing = json.loads(store.compare_set(f"{prefix}/missing", "", json.dumps(missing)))
    present = [r for r in range(world) if r not in missing]
    requests = dict(zip(present, map(AllocationRequest.decode, store.multi_get([keys[r] for r in present]))))
    every = ", ".join(f"rank {r} {requests[r]}" for r in present)
    refusing = [r for r in present if requests[r].refusal]
    if refusing and not missing:  # (a rank that never came is the graver fault: the timeout below names it)
        raise refused_allocation(rank, what, refusing[0], requests[refusing[0]])
    if missing:
        late = f" (this rank, asking for {request}, came after the others had stopped waiting)" \
            if rank in missing else ""
        raise AllocationTimeout(
            f"rank {rank}: {what}: rank(s) {missing} did not ask for it within {timeout_s:g} s{late}; {every}. A "
            "call that makes only some ranks allocate or grow a symmetric buffer (a larger shape on one rank) "
            "would leave the others waiting in the allocation forever")
    if len({(r.name, r.dtype) for r in requests.values()}) > 1:
        raise AllocationMismatch(
            f"rank {rank}: {what}: the ranks asked for different buffers: {every} (every rank must allocate the "
            "same buffers in the same order: GPUs pair them by order, so one rank's buffer would be another's)")
    return max(r.numel for r in requests.values())


# The last epoch an exchange may take: p2p flags hold epochs in int32, compiled launches take them as i32 arguments,
# and device-held counters (the quantized all-reduce's step slots, the MoE dispatch's acknowledged epoch) add 1 in
# int32. Past it an epoch would wrap, and a wait for it take a peer's old flag for this call's (a silent stale read),
# or end every call in an error that does not say why (an OverflowError of Triton's launcher; a flag truncated to
# int32 that no wait sees: a timeout). nvshmem's flags are int64, but one rule serves every exchange: 2**31 calls of
# one exchange are far beyond a run's.
MAX_EPOCH = 2**31 - 1


def next_epoch_after(epoch: int, what: str) -> int:
    """epoch + 1, the next call's epoch of `what` (an exchange or op of one rank, as the error names it); refused
    (RuntimeError) past MAX_EPOCH, before the call launches any kernel. Every rank makes the same calls in the same
    order, so every rank refuses the same call: no peer is left waiting."""
    if epoch >= MAX_EPOCH:
        raise RuntimeError(f"{what} has made {epoch} calls, as many as its int32 epochs count (a wrapped epoch would "
                           "take its peers' old flags for this call's): make a new one (a new workspace)")
    return epoch + 1


@dataclass
class PeerBuffer:
    local: torch.Tensor  # this rank's buffer (1-D)
    peer_ptrs: torch.Tensor  # int64 [world]: base address of every rank's buffer, readable by kernels
    handle: object = None  # what keeps the peers' buffers mapped (alive) for this rank while it holds this


class _Workspace:
    rank: int
    world_size: int
    device: torch.device
    transport = "p2p"  # the simulated world stores through peer pointers too
    simulated = False  # True: the ranks' kernels run one after another in one process (launch phase by phase)

    def __init__(self):
        self._buffers: dict[str, PeerBuffer] = {}
        self._epochs: dict[str, int] = {}  # per exchange: the step counter its ready flags carry (never reset)

    def next_epoch(self, exchange: str) -> int:
        """The exchange's next epoch (from 1; `next_epoch_after`: refused past MAX_EPOCH)."""
        self._epochs[exchange] = self.upcoming_epoch(exchange)
        return self._epochs[exchange]

    def upcoming_epoch(self, exchange: str) -> int:
        """The epoch `next_epoch` would take, refused alike, without taking it: for an op that counts its call only
        once its launches went out (the MoE dispatch's `end`), whose launches must not run past MAX_EPOCH."""
        return next_epoch_after(self._epochs.get(exchange, 0),
                                f"rank {self.rank}: the exchange {exchange!r} of this workspace")

    def epoch(self, exchange: str) -> int:
        """The exchange's last epoch taken (0 before its first), without taking one."""
        return self._epochs.get(exchange, 0)

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> PeerBuffer:
        """A symmetric buffer of at least `numel` elements; flags (int32) start at zero."""
        found = self._buffers.get(name)
        if found is None or found.local.numel() < numel or found.local.dtype != dtype:
            if found is not None and dtype == torch.int32:
                raise RuntimeError(f"flag buffer {name!r} cannot grow: flags carry epochs and are never reset")
            start_s = time.perf_counter()
            allocated = self._allocate(AllocationRequest(name, max(numel, 1), dtype))
            # Growing is a collective that synchronises the device: worth a line in the log.
            log.log(logging.DEBUG if found is None else logging.INFO, "symmetric buffer %r: %d x %s in %.1f ms", name,
                    allocated.local.numel(), dtype, (time.perf_counter() - start_s) * 1e3)
            self._buffers[name] = found = allocated
        return found

    def _allocate(self, request: AllocationRequest) -> PeerBuffer:
        """Collective: every rank's next allocation (the same name and dtype), of the largest numel asked for."""
        raise NotImplementedError

    def refuse_allocation(self, request: AllocationRequest) -> None:
        """Take part in the ranks' next collective allocation, which the peers' call makes (`request`: what they ask
        for) and which this rank's call, refused (request.refusal: why), would make: every rank raises
        AllocationRefused naming this rank and why, and no buffer is made (raising alone would leave the peers
        waiting in it, and the ranks' allocations paired one apart)."""
        assert request.refusal, "a refusal says why"
        self._allocate(request)

    def peer_tensors(self, buf: PeerBuffer) -> list[torch.Tensor]:
        """Every rank's `buf` as a tensor this rank can `copy_` into (copy engines take tensors, not addresses)."""
        raise NotImplementedError


class CudaSymmetricWorkspace(_Workspace):
    def __init__(self, group: dist.ProcessGroup | None = None, allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        super().__init__()
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.allocation_timeout_s = check_allocation_timeout(allocation_timeout_s)  # agree_on_allocation's bound
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def _allocate(self, request: AllocationRequest) -> PeerBuffer:
        # Every rank allocates the largest size any rank asks for: NVSHMEM's heap puts a buffer at the same offset
        # in every PE only if all PEs allocate the same sizes in the same order, and some sizes depend on the
        # rank (the nvshmem lookup's scratch follows the rank's own tables).
        local = self._symm_mem.empty(self._agreed_numel(request), dtype=request.dtype, device=self.device)
        handle = self._symm_mem.rendezvous(local, self.group.group_name)
        local.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=self.group)  # no peer may write before every rank has zeroed its buffer
        ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=self.device)
        return PeerBuffer(local=local, peer_ptrs=ptrs, handle=handle)

    def peer_tensors(self, buf: PeerBuffer) -> list[torch.Tensor]:
        handle = self._symm_mem.rendezvous(buf.local, self.group.group_name)  # cached: no collective after the first
        return [handle.get_buffer(p, (buf.local.numel(),), buf.local.dtype) for p in range(self.world_size)]

    def _agreed_numel(self, request: AllocationRequest) -> int:
        return agree_on_allocation(self.group, request, self.allocation_timeout_s)


class CudaIpcWorkspace(CudaSymmetricWorkspace):
    """Ranks of one host sharing a GPU: each buffer is a device tensor whose CUDA IPC handle every peer opens (torch's
    SymmetricMemory refuses ranks on one device). Kernels and flags are the p2p ones."""

    def _allocate(self, request: AllocationRequest) -> PeerBuffer:
        from torch.multiprocessing.reductions import reduce_tensor

        local = torch.zeros(self._agreed_numel(request), dtype=request.dtype, device=self.device)
        torch.cuda.synchronize()
        rebuild, args = reduce_tensor(local)  # the handle of local's allocation, its offset, a reference count
        shared: list = [None] * self.world_size
        dist.all_gather_object(shared, args, group=self.group)
        tensors = [local if r == self.rank else rebuild(*shared[r]) for r in range(self.world_size)]
        dist.barrier(group=self.group)  # no peer may write before every rank has zeroed its buffer
        ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=self.device)
        return PeerBuffer(local=local, peer_ptrs=ptrs, handle=tensors)

    def peer_tensors(self, buf: PeerBuffer) -> list[torch.Tensor]:
        return buf.handle


def cuda_workspace(group: dist.ProcessGroup | None = None,
                   allocation_timeout_s: float = ALLOCATION_TIMEOUT_S) -> CudaSymmetricWorkspace:
    """The p2p workspace of `group`: SymmetricMemory, or CUDA IPC where two of its ranks share a GPU."""
    group = group or dist.group.WORLD
    kind = CudaIpcWorkspace if ranks_share_a_gpu(group) else CudaSymmetricWorkspace
    return kind(group, allocation_timeout_s)


def ranks_share_a_gpu(group: dist.ProcessGroup) -> bool:
    """Whether two ranks of `group` run on one GPU; never under NCCL, which refuses that (no collective then)."""
    if dist.get_backend(group) == "nccl":
        return False
    here = (socket.gethostname(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    return len(set(everyone)) < len(everyone)


class NvshmemSymmetricWorkspace(CudaSymmetricWorkspace):
    transport = "nvshmem"

    def __init__(self, group: dist.ProcessGroup | None = None, allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        from torch.distributed import _symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise RuntimeError("comm.transport=nvshmem: this torch has no NVSHMEM (use transport=p2p or comm=bulk)")
        use_nvshmem_backend()
        super().__init__(group, allocation_timeout_s)
        self._kept: list[PeerBuffer] = []  # every buffer allocated (see _allocate)

    def _allocate(self, request: AllocationRequest) -> PeerBuffer:
        # nvshmem_free is a collective of all PEs: a buffer released by garbage collection, at another moment in
        # every rank, could hang it. Here the buffers stay allocated for the process's life, grown ones included.
        allocated = super()._allocate(request)
        self._kept.append(allocated)
        return allocated


def use_nvshmem_backend() -> None:
    """Allocate symmetric memory through NVSHMEM from now on: process-wide, and only possible before the
    process's first symmetric allocation."""
    from torch.distributed import _symmetric_memory as symm_mem

    if symm_mem.get_backend(torch.device("cuda", torch.cuda.current_device())) == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as error:
        raise RuntimeError("comm.transport=nvshmem must be chosen before any symmetric memory is allocated in "
                           f"this process ({error})") from error


@dataclass
class _SimulatedAllocation:
    number: int  # the world's n-th allocation (from 1, as agree_on_allocation counts)
    rank: int  # the first rank to make it
    request: AllocationRequest
    tensors: list[torch.Tensor] | None  # every rank's tensor, until every rank has taken them


class SimulatedWorld:
    """The shared memory of a simulated world: rank r's buffers are plain tensors on `device` (the CPU for the
    interpreter), visible to every rank. Buffers pair by the order of the ranks' allocations, as on GPUs."""

    def __init__(self, world_size: int, device: torch.device | str = "cpu"):
        self.world_size, self.device = world_size, torch.device(device)
        self.buffers: dict[str, list[torch.Tensor]] = {}  # by name: every rank's tensor of the newest buffer
        self._newest: dict[str, _SimulatedAllocation] = {}  # by name: the allocation that made buffers[name]
        self._allocations: list[_SimulatedAllocation] = []
        self._made = [0] * world_size  # per rank: how many allocations it made

    def workspaces(self) -> list["SimulatedWorkspace"]:
        return [SimulatedWorkspace(self, r) for r in range(self.world_size)]

    def allocate(self, rank: int, request: AllocationRequest) -> list[torch.Tensor]:
        """Every rank's tensor of `rank`'s next allocation: the first rank to make its n-th allocation creates it,
        the others must ask for the same name and dtype, as GPUs need (AllocationMismatch), and for no more
        elements (GPUs would give every rank the most asked for, but the first rank holds its buffer already)."""
        n = self._made[rank]
        if n == len(self._allocations):
            tensors = None if request.refusal else [torch.zeros(request.numel, dtype=request.dtype, device=self.device)
                                                    for _ in range(self.world_size)]
            self._allocations.append(made := _SimulatedAllocation(n + 1, rank, request, tensors))
            if tensors is not None:
                self.buffers[request.name], self._newest[request.name] = tensors, made
        made = self._allocations[n]
        what = f"symmetric allocation #{n + 1} of the simulated world"
        for refusing, refused in ((made.rank, made.request), (rank, request)):
            if refused.refusal:  # (a peer that came first holds the buffer: here it runs on, as it cannot wait)
                self._made[rank] = n + 1
                raise refused_allocation(rank, what, refusing, refused)
        mine = f"rank {rank}: {what}: rank {made.rank} asked for {made.request}, rank {rank} for {request}"
        if (made.request.name, made.request.dtype) != (request.name, request.dtype):
            raise AllocationMismatch(f"{mine} (every rank must allocate the same buffers in the same order: GPUs "
                                     "pair them by order, so one rank's buffer would be another's)")
        if request.numel > made.request.numel:
            raise AllocationMismatch(f"{mine}: GPUs give every rank the larger, but rank {made.rank} holds its "
                                     "buffer already here (ask for the largest on every rank)")
        tensors, self._made[rank] = made.tensors, n + 1
        if min(self._made) > n:
            made.tensors = None  # taken by every rank: freed once no rank holds it
        return tensors

    def check_held(self, rank: int, held: PeerBuffer, request: AllocationRequest) -> None:
        """Raise unless `held`, the buffer rank `rank` uses for `request`, is its name's newest: a peer that grew
        it without this rank would wait in the allocation forever on GPUs."""
        if held.handle is not self.buffers[request.name]:
            grown = self._newest[request.name]
            raise AllocationTimeout(
                f"rank {rank}: rank {grown.rank} grew {request.name!r} (symmetric allocation #{grown.number} of the "
                f"simulated world: {grown.request}) but rank {rank} asked for {request}, which its buffer of "
                f"{held.local.numel()} holds, and would not join that allocation: on GPUs rank {grown.rank} waits "
                "for it until agree_on_allocation's timeout (a call that makes only some ranks grow a buffer)")


class SimulatedWorkspace(_Workspace):
    simulated = True

    def __init__(self, world: SimulatedWorld, rank: int):
        super().__init__()
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self.device = world.device

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> PeerBuffer:
        held = super().buffer(name, numel, dtype)
        self.world.check_held(self.rank, held, AllocationRequest(name, numel, dtype))
        return held

    def _allocate(self, request: AllocationRequest) -> PeerBuffer:
        # Each rank's PeerBuffer holds all ranks' tensors, as a GPU rank's handle maps its peers' memory: a buffer
        # that grew is freed once no rank holds it.
        tensors = self.world.allocate(self.rank, request)
        ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=self.device)
        return PeerBuffer(local=tensors[self.rank], peer_ptrs=ptrs, handle=tensors)

    def peer_tensors(self, buf: PeerBuffer) -> list[torch.Tensor]:
        return buf.handle
