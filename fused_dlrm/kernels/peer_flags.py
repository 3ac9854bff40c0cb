"""Ready flags between ranks: producers raise them, a small wait kernel polls them, timeouts become errors.

A flag holds the epoch (step number) of the last data written behind it; it is never reset, and readers compare
with `>=` (a fast peer may already have raised the next epoch). Producers raise one flag per (producer rank,
program) in every destination rank after their stores. The consumer's wait kernel has one program per producer
rank, polling that rank's flags; then it acknowledges the epoch back to the producer, which guards the
double-buffered output against being overwritten while the consumer may still read it (after a wait that gave up
too: the call is over there, and a producer that was only late then stores its next call; a producer that gives
up waiting for the ack stores nothing and raises no flag over it, so the consumer never reads a half of an older
call as this one's).
Waits are bounded: every kernel records a timeout through `record_timeout` (the first one per error wins) into an
error word that `PeerErrors` turns into an exception on the host; while the word holds an error the host has not
read, every wait looks once instead of spinning (`_spin_limit_unless_failed`).

Call signatures: ranks whose calls of an op differ (sizes, dtypes, tiles: a caller's bug) would read each other's
slots in another layout, so an op's ranks compare their calls on the device. Each call has a signature
(`signature_of`: int64 words that every rank's call must share, word 0 its epoch), which travels with the data:
stored into each peer beside the data before the flag that releases both (`store_signature`), or, for an op whose
calls of other shapes use other buffers and flags altogether, as a flag of its own (`publish_signature`, whose word 0
releases the rest; `same_published_call` waits for it). A consumer compares a peer's signature with its own once
per call (`same_call`, `same_calls`); one unlike its own records error 3 with both signatures (`record_mismatch`),
which `PeerErrors` names in words (the op's `describe_calls`, built with `describe_signatures`); one alike but for the
step is named as a peer's later (or earlier) call: a rank moved on after a wait timed out.
Where a consumer's reads of a call may outlast its peers' waits for it (a late rank), the last of its programs
through raises a released flag in every rank (`release_when_last`), and a producer's next store into that buffer
waits for it (`released_at_least`: bounded; a timeout stores nothing there and raises no flag).

Refused inputs: where every rank holds every rank's refusal words (exchanged with its data: MoE's counts) but no
host reads them, `record_refused` records the first refused rank (code 5) on every rank alike, and `PeerErrors`
raises it in the op's words (`describe_refused`). Refused calls: an op whose calls carry signatures (the quantized
all-reduce, the GEMM + all-reduce) runs a call that one rank's host refuses (its input) all the same there
(`RefusedCall`): raising on that rank alone would leave its peers waiting, and its epochs behind theirs for good.
Its one-program kernel publishes a signature that says why ([epoch, REFUSED_CALL, refusal words]) with its flags for
every program (`publish_refusal`; or as a flag of its own, `publish_signature`), then waits as the op's calls wait;
each peer, comparing calls (`same_unrefused_calls`, `same_published_call`), records the refused rank (the lowest)
with its words (`refused_peer`, `refused_by`, `record_refusal`) before any mismatch, so every other rank raises
PeerRefusedInput (`describe_refused_calls`, `describe_tensor`) and the refused rank its own error. An operand on
another device than the workspace's is such an input (`foreign_operand`, `describe_foreign`).

Before results are kept (a checkpoint, a run's end), `check_every_error_word` reads every live op's word at once:
on GPUs the word is read every check_every calls, so a wait of the last few calls could otherwise give up unseen.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.env import CallMismatch
from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, aligned
from fused_dlrm.kernels.nvshmem_puts import nvshmem_kernel, set_flag

# Polls of a flag before a wait gives up: about 54 s at the 217 ns per poll measured on H100 (2026-11-27,
# docs/benchmarks.md). Longer than a peer's host may lag behind: a first call compiling its kernels (seconds
# each; at the old bound of 20,000,000 polls, 4.3 s, a first MoE forward timed out), a checkpoint, a pause; a
# lost peer still ends in an error naming rank and slice. Passed as an i32 argument: below 2**31.
DEFAULT_SPIN_LIMIT = 250_000_000


def check_spin_limit(spins: object, what: str) -> None:
    """Refuse a wait's bound (`what`: the setting that gave it) that the waits cannot honour: they count polls in 32
    bits, so from 2**31 on the count wraps before it reaches the bound and a lost peer hangs the wait instead of
    raising; below 1 every wait gives up at its first look; a float (YAML's 2e6) would reach the kernels' int32
    argument as one. Every op calls it where it takes its bound in (its constructor, or its config:
    FusedCommConfig, FusedMoEConfig, GemmConfig), before anything is built."""
    if isinstance(spins, bool) or not isinstance(spins, int) or not 1 <= spins < 2**31:
        raise ValueError(f"{what}={spins!r}: expected a whole number of polls from 1 to 2**31 - 1 (the waits count "
                         f"them in 32 bits; {DEFAULT_SPIN_LIMIT:_} are about 54 s on H100)")

# A call's signature: int64 words that every rank's call must share (their meaning is the op's; word 0 its epoch).
# The error word ([code, peer, slot, epoch, claim, unused x 3], int32) holds, for code 3, both signatures after it.
SIGNATURE_WORDS = tl.constexpr(16)
ERROR_WORDS = 8 + 2 * 2 * SIGNATURE_WORDS.value
MISMATCH = 3  # the error code of a peer's call that differs from this rank's
NOT_STARTED = 4  # the error code of a peer whose published signature never came (it never started the call)
_NOT_STARTED = tl.constexpr(NOT_STARTED)  # the kernels'
REFUSED = 5  # the error code of a rank whose input was refused (`record_refused`), its words where signatures go
_REFUSED = tl.constexpr(REFUSED)
# Word 1 of a refused call's signature ([epoch, REFUSED_CALL, refusal words]): no op's word 1 (a size) is ever -1.
REFUSED_CALL = -1
_REFUSED_CALL = tl.constexpr(REFUSED_CALL)  # the kernels'


@triton.jit
def signal_ready(ready_ptrs, slot, epoch, WORLD: tl.constexpr):
    """After this program's stores: raise flag `slot` in every rank's ready buffer (release, system scope)."""
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        flag = tl.load(ready_ptrs + peer).to(tl.pointer_type(tl.int32)) + slot
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@triton.jit
def signal_peer(flag_ptrs, peer, slot, epoch):
    """After this program's stores into peer: raise peer's flag `slot` (release, system scope)."""
    tl.debug_barrier()
    flag = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + slot
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
def _claim_error(error_ptr, peer, slot, epoch):
    """Claim the error word unless an error is recorded already, and store (peer, slot, epoch) if claimed: the first
    error is the cause, later ones (of this launch, or of later launches before the host reads the word) its
    consequences. The claim word decides between concurrent programs; the code, which kernels poll to stop
    spinning, is written last (by the caller)."""
    claimed = tl.atomic_cas(error_ptr + 4, 0, 1) == 0
    if claimed:
        tl.store(error_ptr + 1, peer)
        tl.store(error_ptr + 2, slot)
        tl.store(error_ptr + 3, epoch)
    return claimed


@triton.jit
def record_timeout(error_ptr, code, peer, slot, epoch):
    """Record a timed-out wait into the error word [code, peer, slot, epoch, claim, unused x 3] unless one is
    recorded already (`_claim_error`). Codes: 1: `peer` never raised its flag for `slot`; 2: `peer` never released
    its buffer (slot: the step it never finished, `released_at_least`); 3 is `record_mismatch`'s; 4: `peer` never
    published its call's signature (slot -1, `same_published_call`); 5 is `record_refusal`'s. `epoch`: the step of
    the failing call, which the host's message names."""
    if _claim_error(error_ptr, peer, slot, epoch):
        tl.atomic_xchg(error_ptr, code)


@triton.jit
def record_mismatch(error_ptr, peer, slot, epoch, mine, theirs):
    """Record (code 3) that `peer`'s call, seen behind its flag for `slot`, differs from this rank's: both
    signatures (int64 [SIGNATURE_WORDS] each, this rank's first) go after the word's first 8 int32, for the host's
    message. The first error wins, as with timeouts."""
    if _claim_error(error_ptr, peer, slot, epoch):
        signatures = (error_ptr + 8).to(tl.pointer_type(tl.int64)) + tl.arange(0, SIGNATURE_WORDS)
        tl.store(signatures, mine)
        tl.store(signatures + SIGNATURE_WORDS, theirs)
        tl.atomic_xchg(error_ptr, 3)


@triton.jit
def record_refusal(error_ptr, refused, epoch, words):
    """Record (code 5, slot -1) that rank `refused`'s input was refused, with its refusal words (int64
    [SIGNATURE_WORDS]: where signatures go, for the op's `describe_refused`). The first error wins, as with
    timeouts."""
    if _claim_error(error_ptr, refused, -1, epoch):
        tl.store((error_ptr + 8).to(tl.pointer_type(tl.int64)) + tl.arange(0, SIGNATURE_WORDS), words)
        tl.atomic_xchg(error_ptr, _REFUSED)


@triton.jit(do_not_specialize=["stride", "rank", "epoch"])  # one compiled binary serves every step
def _record_refused_kernel(words_ptr, stride, error_ptr, rank, epoch, WORLD: tl.constexpr, W_P2: tl.constexpr,
                           N: tl.constexpr):
    """One program: `record_refused`."""
    s = tl.arange(0, W_P2)
    codes = tl.load(words_ptr + s * stride, mask=s < WORLD, other=0)
    first = tl.min(tl.where(codes != 0, s, WORLD), axis=0)
    refused = tl.where(tl.load(words_ptr + rank * stride) != 0, rank, first)
    if refused < WORLD:
        w = tl.arange(0, SIGNATURE_WORDS)
        record_refusal(error_ptr, refused, epoch, tl.load(words_ptr + refused * stride + w, mask=w < N, other=0))


_RECORD_REFUSED_LAUNCHES = CompiledLaunches(_record_refused_kernel)


def record_refused(words: torch.Tensor, error: torch.Tensor, rank: int, epoch: int) -> None:
    """Enqueue: record (code 5, slot -1) the rank whose input was refused, if any, into `error` unless an error is
    recorded already. words: int64 [world, n] (n <= SIGNATURE_WORDS; rows may be strided), every rank's refusal
    words, word 0 a code (0: not refused), the same on every rank: every rank records the same rank (this one if
    it was refused, else the first) and its words, and its PeerErrors raises it (`describe_refused`)."""
    world, n = words.shape
    if n > SIGNATURE_WORDS.value or words.dtype != torch.int64 or words.stride(1) != 1:
        raise ValueError(f"refusal words must be int64 [world, <= {SIGNATURE_WORDS.value}] with rows of contiguous "
                         f"words, got {tuple(words.shape)} {words.dtype} strides {words.stride()}")
    shape = (world, triton.next_power_of_2(world), n)
    _RECORD_REFUSED_LAUNCHES((words.device, *shape, aligned(words), aligned(error)), (1, 1, 1),
                             (words, words.stride(0), error, rank, epoch, *shape), dict(num_warps=1))


@triton.jit
def recorded_at(error_ptr, epoch):
    """Whether the error word holds an error of step `epoch` (not yet read by the host): how a phase launched
    apart from the one that recorded it (a simulated world) learns that the call has failed."""
    code = tl.atomic_add(error_ptr, 0, sem="acquire")
    return (code != 0) & (tl.load(error_ptr + 3, volatile=True) == epoch)


@triton.jit
def wait_or_record(flag, epoch, spin_limit, error_ptr, peer, slot):
    """Bounded wait for *flag >= epoch; returns whether it got there. A timeout records (1, peer, slot, epoch);
    once a timeout is recorded (and not yet read by the host), waits look once instead of spinning: their
    results are lost anyway, and the launch must end."""
    return _wait_or_record_code(flag, epoch, spin_limit, error_ptr, 1, peer, slot)


@triton.jit
def _spin_limit_unless_failed(error_ptr, spin_limit):
    """A wait's bound: spin_limit, or 0 (look once) while the error word holds an error the host has not read yet:
    the wait's result is lost anyway, and on GPUs the host reads the word only every check_every calls, each of
    whose waits would otherwise spin its whole bound first."""
    return tl.where(tl.atomic_add(error_ptr, 0) != 0, 0, spin_limit)


@triton.jit
def _wait_or_record_code(flag, epoch, spin_limit, error_ptr, code, peer, slot):
    """wait_or_record, whose timeout records error `code`."""
    arrived = wait_at_least(flag, epoch, _spin_limit_unless_failed(error_ptr, spin_limit))
    if arrived == 0:
        record_timeout(error_ptr, code, peer, slot, epoch)
    return arrived


@triton.jit
def signature_of(words):
    """A call's signature (int64 [SIGNATURE_WORDS]) from a tuple of at most SIGNATURE_WORDS scalars, word 0 the
    call's epoch (a signature of another call is of another step); the words past the tuple are 0."""
    tl.static_assert(len(words) <= SIGNATURE_WORDS, "a call's signature has at most SIGNATURE_WORDS words")
    w = tl.arange(0, SIGNATURE_WORDS)
    signature = tl.zeros([SIGNATURE_WORDS], tl.int64)
    for i in tl.static_range(len(words)):
        signature = tl.where(w == i, words[i], signature)
    return signature


@triton.jit
def _signature_slot(signature_ptrs, dest, offset, source):
    """Where dest's signature buffer (from word `offset`: e.g. a half by epoch parity) holds source's signature."""
    return tl.load(signature_ptrs + dest).to(tl.pointer_type(tl.int64)) + offset + source * SIGNATURE_WORDS


@triton.jit
def store_signature(signature_ptrs, dest, offset, rank, signature):
    """Store this rank's `signature` at [rank] of dest's signature buffer (signature_ptrs: the peer-pointer table;
    from word `offset`), before the flag that releases the data beside it: the flag releases the signature too."""
    tl.store(_signature_slot(signature_ptrs, dest, offset, rank) + tl.arange(0, SIGNATURE_WORDS), signature)


@triton.jit
def publish_signature(signature_ptrs, dest, offset, rank, signature, epoch):
    """Store this rank's `signature` at [rank] of dest's signature buffer as a flag of its own: words 1... first,
    then word 0, the epoch, with release (system scope), so a reader that sees the epoch sees the rest
    (`same_published_call`)."""
    slot = _signature_slot(signature_ptrs, dest, offset, rank)
    w = tl.arange(0, SIGNATURE_WORDS)
    tl.store(slot + w, signature, mask=w > 0)
    tl.debug_barrier()
    tl.atomic_xchg(slot, epoch, sem="release", scope="sys")


@triton.jit
def same_call(signatures, peer, mine, error_ptr, slot, epoch):
    """Whether peer's call is this rank's: its signature at `signatures` + peer * SIGNATURE_WORDS (this rank's
    buffer, behind a flag of the peer's call that this program has seen) equals mine. A mismatch is recorded (the
    first error of the op wins; `slot`, `epoch`: where and at which step)."""
    theirs = tl.load(signatures + peer * SIGNATURE_WORDS + tl.arange(0, SIGNATURE_WORDS))
    same = tl.max((theirs != mine).to(tl.int32), axis=0) == 0
    if not same:
        record_mismatch(error_ptr, peer, slot, epoch, mine, theirs)
    return same


@triton.jit
def same_calls(signatures, rank, mine, error_ptr, slot, epoch, WORLD: tl.constexpr):
    """`same_call` for every peer (the next rank first)."""
    same = True
    for k in tl.static_range(1, WORLD):
        same &= same_call(signatures, (rank + k) % WORLD, mine, error_ptr, slot, epoch)
    return same


@triton.jit
def refused_peer(signatures, rank, error_ptr, epoch, WORLD: tl.constexpr):
    """Whether a peer refused this call (its signature at `signatures` + peer * SIGNATURE_WORDS, behind a flag of the
    call, is a refused call's: `publish_refusal`); if so the lowest such rank, the same on every rank, is recorded
    with its refusal words (code 5, `record_refusal`)."""
    refused = WORLD
    for k in tl.static_range(WORLD):  # from the last rank down: the lowest refused one stays
        s = WORLD - 1 - k
        word = tl.load(signatures + s * SIGNATURE_WORDS + 1)
        refused = tl.where((s != rank) & (word == _REFUSED_CALL), s, refused)
    if refused < WORLD:
        record_refusal(error_ptr, refused, epoch,
                       tl.load(signatures + refused * SIGNATURE_WORDS + tl.arange(0, SIGNATURE_WORDS)))
    return refused < WORLD


@triton.jit
def refused_by(signatures, peer, error_ptr, epoch):
    """`refused_peer` for one peer: whether its signature (behind a flag of the call) is a refused call's; if so it
    is recorded (code 5) with its refusal words."""
    refused = tl.load(signatures + peer * SIGNATURE_WORDS + 1) == _REFUSED_CALL
    if refused:
        record_refusal(error_ptr, peer, epoch,
                       tl.load(signatures + peer * SIGNATURE_WORDS + tl.arange(0, SIGNATURE_WORDS)))
    return refused


@triton.jit
def same_unrefused_calls(signatures, rank, mine, error_ptr, slot, epoch, WORLD: tl.constexpr):
    """`same_calls`, unless a peer refused the call (`refused_peer`: the refusal, recorded, is the cause of any
    mismatch)."""
    same = refused_peer(signatures, rank, error_ptr, epoch, WORLD) == 0
    if same:
        same = same_calls(signatures, rank, mine, error_ptr, slot, epoch, WORLD)
    return same


@triton.jit
def signal_every_program(flag_ptrs, peer, rank, stride, epoch, SLOTS: tl.constexpr):
    """After this program's stores into peer: raise peer's flags [rank, p] (flag_ptrs: the peer-pointer table of
    flags laid out [rank][stride]) for every p < stride (<= SLOTS): a refused call's, whose peers' grid is not
    known."""
    tl.debug_barrier()
    p = tl.arange(0, SLOTS)
    flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + rank * stride + p
    tl.atomic_xchg(flags, tl.zeros([SLOTS], tl.int32) + epoch, mask=p < stride, sem="release", scope="sys")


@triton.jit
def publish_refusal(signature_ptr, epoch, signature_ptrs, offset, ready_ptrs, peer, rank, stride,
                    SLOTS: tl.constexpr):
    """A refused call's part in `peer` (its kernel's: one program): its signature (signature_ptr: a `RefusedCall`'s,
    with `epoch` put into word 0) at [rank] of peer's signature buffer (from word `offset`), then its ready flags
    there for every program (`signal_every_program`), which release it: every program of the peer's call finds it
    where it compares calls (`same_unrefused_calls`)."""
    w = tl.arange(0, SIGNATURE_WORDS)
    store_signature(signature_ptrs, peer, offset, rank, tl.where(w == 0, epoch, tl.load(signature_ptr + w)))
    signal_every_program(ready_ptrs, peer, rank, stride, epoch, SLOTS)


@dataclass
class RefusedCall:
    """A call this rank's host refused, still run there (`publish_refusal`, the module docstring): the error it raises
    itself, and the signature that tells its peers why ([0: the kernel puts the epoch, REFUSED_CALL, refusal words],
    int64 [SIGNATURE_WORDS] on the device)."""
    error: Exception
    signature: torch.Tensor

    @classmethod
    def of(cls, words: list[int], error: Exception, device: torch.device) -> RefusedCall:
        """words: why (at most SIGNATURE_WORDS - 2 integers, word 0 the op's reason), which the peers' describe_refused
        reads (`describe_refused_calls`)."""
        signature = torch.zeros(SIGNATURE_WORDS.value, dtype=torch.int64)
        signature[1:2 + len(words)] = torch.tensor([REFUSED_CALL] + words)
        return cls(error, signature.to(device))


TENSOR_DIMS = 3  # the dims of a tensor that its refusal words list (`tensor_words`)
TENSOR_WORDS = TENSOR_DIMS + 2


def tensor_words(t: torch.Tensor) -> list[int]:
    """A tensor in a refusal's words: its dim count, first TENSOR_DIMS dims (-1 past its last) and `dtype_code`
    (TENSOR_WORDS integers)."""
    dims = list(t.shape[:TENSOR_DIMS])
    return [t.dim()] + dims + [-1] * (TENSOR_DIMS - len(dims)) + [dtype_code(t.dtype)]


def describe_tensor(words: list[int]) -> str:
    """`tensor_words` in words: "[2, 3, 40] bfloat16"."""
    ndim, dims, dtype = words[0], words[1:1 + TENSOR_DIMS], words[1 + TENSOR_DIMS]
    shown = [str(d) for d in dims[:ndim]] + (["..."] if ndim > TENSOR_DIMS else [])
    return f"[{', '.join(shown)}] {dtype_name(dtype)}"


def foreign_operand(operands: dict[str, torch.Tensor | None], device: torch.device
                    ) -> tuple[list[int], ValueError] | None:
    """The first of a call's operands (by name; None: not given) that lies on another device than `device`, the
    workspace buffers' own (with its index: "cuda:0" where a simulated GPU world's workspace says "cuda"): its index
    among them and `tensor_words` (refusal words, `describe_foreign`) and the error its rank raises; None where every
    one lies there. Checked before anything reads them: a kernel would fail on that rank alone, or read (or store
    into) another GPU's memory through its pointer."""
    for i, (name, t) in enumerate(operands.items()):
        if t is not None and t.device != device:
            return [i] + tensor_words(t), ValueError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device}: expected on "
                                                     f"{device}, the workspace's device")
    return None


def describe_foreign(names: tuple[str, ...], values: list[int]) -> str:
    """`foreign_operand`'s words in words (names: the operands' names, in its order), as the peers say them."""
    return f"its {names[values[0]]} {describe_tensor(values[1:])} is on another device than its workspace"


def describe_refused_calls(rank: int, describe: Callable[[list[int]], str]) -> Callable[[int, list[int]], str]:
    """PeerErrors' describe_refused for an op of `RefusedCall`s: what rank `rank` says of a refused rank's call,
    `describe` reading its refusal words."""
    return lambda refused, signature: f"rank {rank}: rank {refused}'s call was refused: {describe(signature[2:])}"


@triton.jit
def wait_published(signatures, peer, epoch, spin_limit, error_ptr):
    """Bounded wait until `peer` has published (`publish_signature`) its call `epoch` into this rank's `signatures`.
    A timeout records (4, peer, -1, epoch): the peer never started the call."""
    return _wait_or_record_code(signatures + peer * SIGNATURE_WORDS, epoch, spin_limit, error_ptr, _NOT_STARTED,
                                peer, -1)


@triton.jit
def same_published_call(signatures, peer, mine, epoch, spin_limit, error_ptr):
    """`wait_published`, then `same_call`, unless the peer refused the call (its signature a refused call's:
    recorded, code 5, `refused_by`)."""
    same = wait_published(signatures, peer, epoch, spin_limit, error_ptr)
    tl.debug_barrier()  # the word this program's threads acquired covers the words any of them loads
    if same:
        same = refused_by(signatures, peer, error_ptr, epoch) == 0
        if same:
            same = same_call(signatures, peer, mine, error_ptr, -1, epoch)
    return same


@triton.jit
def consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr):
    """Before storing into `dest`'s double-buffered output: has dest acknowledged epoch - 1 (so it no longer
    reads what epoch - 2 wrote there)? A timeout records error 2 and returns False (the caller skips its stores)."""
    return released_at_least(ack_ptr, dest, epoch - 1, epoch, spin_limit, error_ptr)


@triton.jit
def released_at_least(ack_ptr, dest, step, epoch, spin_limit, error_ptr):
    """Before call `epoch` stores into `dest`: has dest released its call `step` (ack_ptr[dest] >= step: its reads of
    what that call was sent are over)? A timeout records (2, dest, step, epoch) and returns False (the caller stores
    nothing there and raises no flag)."""
    acked = wait_at_least(ack_ptr + dest, step, _spin_limit_unless_failed(error_ptr, spin_limit))
    if acked == 0:
        record_timeout(error_ptr, 2, dest, step, epoch)
    return acked


@triton.jit
def release_when_last(count_ptr, released_ptrs, rank, epoch, WORLD: tl.constexpr):
    """After this program's reads of call `epoch`'s data that peers stored into this rank: the last of the launch's
    programs through (a counter at count_ptr, one acq_rel atomic per program; the last one resets it for the next
    launch) raises released[rank] = epoch in every rank (released_ptrs: the peer-pointer table), which the peers'
    later stores into this rank wait for (`released_at_least`). A program whose waits gave up counts too: its
    reads are over."""
    tl.debug_barrier()  # every thread's reads of this program
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.atomic_xchg(count_ptr, 0)
        signal_ready(released_ptrs, rank, epoch, WORLD)


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
def poll_ready(flags, epoch, count, spin_limit, BLOCK: tl.constexpr):
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


@triton.jit(do_not_specialize=["epoch"])  # one compiled binary serves every step (kernels/launch.py)
def _wait_ready_kernel(ready_ptr, ack_ptrs, error_ptr, rank, epoch, slots_per_rank, spin_limit,
                       BLOCK: tl.constexpr):
    producer = tl.program_id(0)
    ok, late = poll_ready(ready_ptr + producer * slots_per_rank, epoch, slots_per_rank,
                           _spin_limit_unless_failed(error_ptr, spin_limit), BLOCK)
    if not ok:
        record_timeout(error_ptr, 1, producer, late, epoch)
    # The ack even after a timeout: this call is over here, and a producer that was only late stores its next
    # call (without it, every later call of that producer timed out waiting for this rank's release).
    ack = tl.load(ack_ptrs + producer).to(tl.pointer_type(tl.int32)) + rank
    tl.atomic_xchg(ack, epoch, sem="release", scope="sys")


@triton.jit
def _wait_ready_nvshmem_kernel(ready_ptr, ack_ptr, error_ptr, rank, epoch, slots_per_rank, spin_limit,
                               BLOCK: tl.constexpr):
    """The same with 64-bit flags; the ack is an NVSHMEM signal into the producer's `ack_ptr + rank`."""
    producer = tl.program_id(0)
    ok, late = poll_ready(ready_ptr + producer * slots_per_rank, epoch, slots_per_rank,
                           _spin_limit_unless_failed(error_ptr, spin_limit), BLOCK)
    if not ok:
        record_timeout(error_ptr, 1, producer, late, epoch)
    set_flag(ack_ptr + rank, epoch, rank, producer)  # after a timeout too (`_wait_ready_kernel`)


class ReadyWait:
    """`wait_ready` (p2p) for an exchange whose flags, acks and error word stay the same: the arguments are
    built once and each epoch launches the compiled binary (kernels/launch.py), a few microseconds of host
    time instead of Triton's per-call argument binding."""

    def __init__(self, ready: torch.Tensor, acks: torch.Tensor, error: torch.Tensor, rank: int, world_size: int,
                 slots_per_rank: int, spin_limit: int):
        self._launches = CompiledLaunches(_wait_ready_kernel)
        self._args = Arguments(_wait_ready_kernel, ("epoch",), ready_ptr=ready, ack_ptrs=acks, error_ptr=error,
                               rank=rank, slots_per_rank=slots_per_rank, spin_limit=spin_limit,
                               BLOCK=triton.next_power_of_2(slots_per_rank))
        self._grid = (world_size, 1, 1)

    def __call__(self, epoch: int) -> None:
        self._launches("wait", self._grid, self._args(epoch), {})


class PeerWaitTimeout(RuntimeError):
    pass


class PeerCallMismatch(CallMismatch):
    """A peer called the op with another signature (size, dtype, codec, ...) than this rank: bad input, not a lost
    peer (a CallMismatch, a ValueError, as the bulk collectives' check on gloo raises)."""


class PeerRefusedInput(ValueError):
    """A rank's input was refused (`record_refused`): bad input, raised on every rank."""


def wait_ready(ready: torch.Tensor, acks: torch.Tensor, error: torch.Tensor, rank: int, world_size: int,
               epoch: int, slots_per_rank: int, spin_limit: int, nvshmem: bool = False) -> None:
    """Enqueue the wait for every producer's `slots_per_rank` flags of `epoch` (non-blocking on GPUs).
    acks: p2p: the peer-pointer table of the producers' ack words; nvshmem: this rank's (symmetric) ack words."""
    kernel = nvshmem_kernel(_wait_ready_nvshmem_kernel) if nvshmem else _wait_ready_kernel
    kernel[(world_size,)](ready, acks, error, rank, epoch, slots_per_rank, spin_limit,
                          BLOCK=triton.next_power_of_2(slots_per_rank))


class CopySchedule:
    """When PeerErrors copies its error word to the host on GPUs (plain bookkeeping, testable without CUDA).

    A copy (plus an event to query) costs the host about 8 us, several times the kernel time of a small call, so
    it is not taken after every call: only once `every` calls have gone by since the last one, and only when no
    copy is in flight (there is one pinned buffer). Calls are counted, not epochs: one PeerErrors may serve
    exchanges with their own epoch counters.
    """

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"check_every must be >= 1, got {every}")
        self.every = every
        self.calls = 0  # calls whose waits were enqueued
        self.covered = 0  # calls enqueued before the latest copy (the copy sees their records)
        self.in_flight = False  # the latest copy is not inspected yet

    def call(self) -> bool:
        """One more call's waits were enqueued: whether to enqueue a copy behind them now."""
        self.calls += 1
        return not self.in_flight and self.calls - self.covered >= self.every

    def copied(self) -> None:
        self.covered, self.in_flight = self.calls, True

    def inspected(self) -> None:
        self.in_flight = False

    def uncovered(self) -> bool:
        """Whether calls were made after the latest copy."""
        return self.covered < self.calls


def describe_signatures(mine: list[int], theirs: list[int], describe: Callable[[list[int]], str],
                        extras: dict[int, str]) -> tuple[str, str]:
    """Two calls' signatures (`signature_of`'s words, this rank's and the peer's) in words, for PeerErrors'
    describe_calls: `describe`'s words for each (what the call does), then each word of `extras` (index: a format
    of its value) and the step (word 0) where the two differ."""
    extras = {**extras, 0: "step {}"}
    return tuple(", ".join([describe(signature)] +
                           [text.format(signature[i]) for i, text in extras.items() if signature[i] != other[i]])
                 for signature, other in ((mine, theirs), (theirs, mine)))


PEER_ERRORS = (PeerWaitTimeout, PeerCallMismatch, PeerRefusedInput)  # what PeerErrors raises
_LIVE_ERROR_WORDS: weakref.WeakSet[PeerErrors] = weakref.WeakSet()  # every fused op's PeerErrors while it lives


def check_every_error_word() -> None:
    """`check(block=True)` of every fused op's error word in this process: raise the first recorded error (one of
    PEER_ERRORS) of any call made so far. Before results are kept, where no later call would surface it."""
    for errors in list(_LIVE_ERROR_WORDS):
        errors.check(block=True)


class PeerErrors:
    """The error word that one rank's bounded waits write (`record_timeout`); read on the host without stalling.

    On the CPU (interpreter) `after_wait` reads the word at once and raises. On GPUs the word stays on the device:
    after every `check_every`-th call (`CopySchedule`) `after_wait` enqueues a copy to pinned memory behind the
    call's waits, and `check()` (non-blocking, at the start of every call) raises if a completed copy shows a
    timeout. So a timeout of call e is in the copy taken at the latest after call e + check_every - 1 (or, if a
    copy is then still in flight, after the first call once that one was inspected) and raises at the first
    `check()` after that copy completed: typically within check_every calls, later only if the host runs that far
    ahead of the GPU. `check(block=True)` copies the word of the latest call, waits for it and raises: call it
    before trusting results (end of a benchmark or a test). Nothing is lost: the word keeps the first timeout
    (with the step of the failing call, so the message is exact however late it surfaces) until the host reads
    it; meanwhile later waits give up at once (their results are lost anyway).
    """

    def __init__(self, device: torch.device, rank: int, what: str, check_every: int = 16,
                 describe_calls: Callable[[list[int], list[int]], tuple[str, str]] | None = None,
                 describe_refused: Callable[[int, list[int]], str] | None = None):
        # [code, peer, slot, epoch, claim] (record_timeout), padded to 32 bytes: one aligned sector; then room for
        # two signatures (record_mismatch)
        self.word = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
        self.rank, self.what = rank, what
        # (this rank's signature, the peer's) -> both in words: the op's reading of a mismatch's signatures
        self.describe_calls = describe_calls
        # (refused rank, its refusal words) -> the op's message (record_refused)
        self.describe_refused = describe_refused
        self.schedule = CopySchedule(check_every)
        self._host = torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else None
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        _LIVE_ERROR_WORDS.add(self)

    def after_wait(self) -> None:
        """A call's waits are enqueued (a timeout's message names the step the kernel recorded: the failing one)."""
        if self._host is None:
            self._raise_if_set(self.word)
        elif self.schedule.call():
            self._copy()

    def check(self, block: bool = False) -> None:
        """Raise PeerWaitTimeout if a completed copy shows a timeout; block=True: of every call made so far."""
        if self._host is None:
            return
        if self.schedule.in_flight and (block or self._event.query()):
            self._inspect()
        if block and self.schedule.uncovered():
            self._copy()
            self._inspect()

    def _copy(self) -> None:
        self._host.copy_(self.word, non_blocking=True)
        self._event.record()
        self.schedule.copied()

    def _inspect(self) -> None:
        self._event.synchronize()
        self.schedule.inspected()
        self._raise_if_set(self._host)

    def _raise_if_set(self, word: torch.Tensor) -> None:
        code, peer, slot, epoch = word[:4].tolist()
        if not code:
            return
        mine, theirs = word[8:].view(torch.int64).view(2, -1).tolist()
        self.word.zero_()
        if code == MISMATCH:
            why = "every rank must make the same calls in the same order"
            if mine[1:] == theirs[1:]:  # the same call but for the step (word 0): no caller's bug
                why = (f"peer {peer}'s call is {'a later' if theirs[0] > mine[0] else 'an earlier'} one: a rank moved "
                       "on after a wait for its peer timed out")
            mine, theirs = self.describe_calls(mine, theirs) if self.describe_calls else (mine, theirs)
            raise PeerCallMismatch(f"{self.what}: rank {self.rank} at step {epoch}: peer {peer} called it with "
                                   f"{theirs}; this rank with {mine} ({why})")
        if code == REFUSED:
            text = (self.describe_refused(peer, mine) if self.describe_refused else
                    f"rank {self.rank}: rank {peer}'s input was refused (words {mine})")
            raise PeerRefusedInput(f"{self.what} at step {epoch}: {text}")
        if code == NOT_STARTED:
            raise PeerWaitTimeout(f"{self.what}: rank {self.rank} timed out at step {epoch} waiting for rank {peer} "
                                  f"to start the call (its call's signature never came)")
        if code == 2:
            raise PeerWaitTimeout(f"{self.what}: rank {self.rank} timed out at step {epoch} waiting for rank {peer} "
                                  f"to release its buffer (rank {peer} never finished step {slot})")
        raise PeerWaitTimeout(f"{self.what}: rank {self.rank} timed out at step {epoch} waiting for rank {peer}, "
                              f"slice {slot} (the peer never raised its ready flag)")
