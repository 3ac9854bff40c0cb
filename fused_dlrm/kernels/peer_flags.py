"""Ready flags between ranks: producers raise them, a small wait kernel polls them, timeouts become errors.

A flag holds the epoch (step number) of the last data written behind it; it is never reset, and readers compare
with `>=` (a fast peer may already have raised the next epoch). Producers raise one flag per (producer rank,
program) in every destination rank after their stores. The consumer's wait kernel has one program per producer
rank, polling that rank's flags; when they are all up it acknowledges the epoch back to the producer, which
guards the double-buffered output against being overwritten while the consumer may still read it.
Waits are bounded: a timeout writes (1, producer rank, slot) into an error word the host turns into an exception.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.nvshmem_puts import nvshmem_kernel, set_flag


@triton.jit
def signal_ready(ready_ptrs, slot, epoch, WORLD: tl.constexpr):
    """After this program's stores: raise flag `slot` in every rank's ready buffer (release, system scope)."""
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        flag = tl.load(ready_ptrs + peer).to(tl.pointer_type(tl.int32)) + slot
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@triton.jit
def wait_at_least(flag, epoch, spin_limit):
    """Spin (bounded) until *flag >= epoch; returns whether it got there."""
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < epoch) & (spins < spin_limit):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins += 1
    return seen >= epoch


@triton.jit
def consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr):
    """Before storing into `dest`'s double-buffered output: has dest acknowledged epoch - 1 (so it no longer
    reads what epoch - 2 wrote there)? A timeout records error 2 and returns False (the caller skips its stores)."""
    failed = tl.atomic_add(error_ptr, 0) != 0  # a wait of this launch already timed out: do not spin again
    acked = wait_at_least(ack_ptr + dest, epoch - 1, tl.where(failed, 0, spin_limit))
    if acked == 0:
        tl.store(error_ptr + 1, dest)
        tl.store(error_ptr + 2, -1)
        tl.atomic_xchg(error_ptr, 2)
    return acked


@triton.jit
def released_once_per_dest(ack_ptr, dest, epoch, spin_limit, error_ptr, known_dest, known_released):
    """consumer_released, asked again only when `dest` changes: a program walks its tiles destination by
    destination, and an ack read per tile costs as much as a small tile's stores. Returns the new (known_dest,
    known_released); start from (-1, False)."""
    if dest != known_dest:
        known_released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
        known_dest = dest
    return known_dest, known_released


@triton.jit
def _poll_ready(flags, epoch, count, spin_limit, BLOCK: tl.constexpr):
    """Spin (bounded) until the `count` flags at `flags` all hold >= epoch: (all up, first late slot)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < count
    zero = tl.zeros([BLOCK], flags.dtype.element_ty)
    seen = tl.where(mask, tl.atomic_add(flags + offs, zero, mask=mask, sem="acquire", scope="sys"), epoch)
    spins = 0
    while (tl.min(seen, axis=0) < epoch) & (spins < spin_limit):
        seen = tl.where(mask, tl.atomic_add(flags + offs, zero, mask=mask, sem="acquire", scope="sys"), epoch)
        spins += 1
    return tl.min(seen, axis=0) >= epoch, tl.min(tl.where(seen < epoch, offs, BLOCK), axis=0)


@triton.jit
def _report_late(error_ptr, producer, late):
    tl.store(error_ptr + 1, producer)
    tl.store(error_ptr + 2, late)
    tl.atomic_xchg(error_ptr, 1)


@triton.jit
def _wait_ready_kernel(ready_ptr, ack_ptrs, error_ptr, rank, epoch, slots_per_rank, spin_limit,
                       BLOCK: tl.constexpr):
    producer = tl.program_id(0)
    ok, late = _poll_ready(ready_ptr + producer * slots_per_rank, epoch, slots_per_rank, spin_limit, BLOCK)
    if ok:
        ack = tl.load(ack_ptrs + producer).to(tl.pointer_type(tl.int32)) + rank
        tl.atomic_xchg(ack, epoch, sem="release", scope="sys")
    else:
        _report_late(error_ptr, producer, late)


@triton.jit
def _wait_ready_nvshmem_kernel(ready_ptr, ack_ptr, error_ptr, rank, epoch, slots_per_rank, spin_limit,
                               BLOCK: tl.constexpr):
    """The same with 64-bit flags; the ack is an NVSHMEM signal into the producer's `ack_ptr + rank`."""
    producer = tl.program_id(0)
    ok, late = _poll_ready(ready_ptr + producer * slots_per_rank, epoch, slots_per_rank, spin_limit, BLOCK)
    if ok:
        set_flag(ack_ptr + rank, epoch, rank, producer)
    else:
        _report_late(error_ptr, producer, late)


class PeerWaitTimeout(RuntimeError):
    pass


def wait_ready(ready: torch.Tensor, acks: torch.Tensor, error: torch.Tensor, rank: int, world_size: int,
               epoch: int, slots_per_rank: int, spin_limit: int, nvshmem: bool = False) -> None:
    """Enqueue the wait for every producer's `slots_per_rank` flags of `epoch` (non-blocking on GPUs).
    acks: p2p: the peer-pointer table of the producers' ack words; nvshmem: this rank's (symmetric) ack words."""
    kernel = nvshmem_kernel(_wait_ready_nvshmem_kernel) if nvshmem else _wait_ready_kernel
    kernel[(world_size,)](ready, acks, error, rank, epoch, slots_per_rank, spin_limit,
                          BLOCK=triton.next_power_of_2(slots_per_rank))


class PeerErrors:
    """The error word that one rank's bounded waits write; read on the host without stalling every step.

    On GPUs the word is copied to pinned memory after each wait and checked at the next `check()` (every step,
    non-blocking) or `check(block=True)`; on the CPU (interpreter) it is checked at once.
    """

    def __init__(self, device: torch.device, rank: int, what: str):
        self.word = torch.zeros(4, dtype=torch.int32, device=device)
        self.rank, self.what = rank, what
        self._host = torch.zeros(4, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else None
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending: int | None = None  # epoch whose copy is in flight

    def after_wait(self, epoch: int) -> None:
        if self._host is None:
            self._raise_if_set(self.word.tolist(), epoch)
            return
        self._host.copy_(self.word, non_blocking=True)
        self._event.record()
        self._pending = epoch

    def check(self, block: bool = False) -> None:
        if self._pending is None or (not block and not self._event.query()):
            return
        self._event.synchronize()
        epoch, self._pending = self._pending, None
        self._raise_if_set(self._host.tolist(), epoch)

    def _raise_if_set(self, word: list[int], epoch: int) -> None:
        code, peer, slot, _ = word
        if not code:
            return
        self.word.zero_()
        if code == 2:
            raise PeerWaitTimeout(f"{self.what}: rank {self.rank} timed out at step {epoch} waiting for rank {peer} "
                                  f"to release its buffer (rank {peer} never finished step {epoch - 1})")
        raise PeerWaitTimeout(f"{self.what}: rank {self.rank} timed out at step {epoch} waiting for rank {peer}, "
                              f"slice {slot} (the peer never raised its ready flag)")
