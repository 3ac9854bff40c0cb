"""Quantized two-shot all-reduce in one kernel launch on symmetric memory (the fused twin of
fused_dlrm.tp.quantized_allreduce's bulk all-reduce, with the same arithmetic bit for bit).

x (n values) is cut into `world` chunks of `chunk_blocks` whole 32-value blocks (zero-padded at the end), each
chunk into tiles of TILE_BLOCKS blocks; program p of every rank handles tiles p, p + P, ... of every chunk (P
programs, the same on every rank). Every rank's `recv` and `gather` symmetric buffers each hold one encoding of
world x chunk_blocks blocks in quant_codecs' planar format, block s * chunk_blocks + j being source s's block j:
int32 payload words [source][chunk_blocks][words], then bf16 scales [source][chunk_blocks]. So a tile of a
source is one contiguous run of whole words (and one of scales): with the buffers' 16-byte alignment (checked by
each plan, hinted to the compiler) its loads and stores, local or over NVLink, are vectors as wide as a thread's
share of the tile allows (128-bit from 4 words per thread on; 64-bit for q6's 6-word blocks). One launch runs
three phases per program:
1. scatter: for every destination d (remote ranks first, rotated by rank, self last) encode the program's tiles
   of chunk d and store them straight into d's `recv` at [source = me]; then, d a peer, store the call's
   signature into d's `signatures` at [me] and raise flag ready[me, p] in d (release, system scope) with the
   call's epoch;
2. reduce: wait (bounded) for ready[s, p] >= epoch from every peer s, check s's signature against mine, decode
   the tiles of my chunk from every source and sum them in fp32 in rank order 0, 1, ... (divided by world with
   mean), re-encode the sum and store it into every rank's `gather` at [source = me] (remote first), then raise
   done[me, p] in every peer (not where a wait gave up: below);
3. gather: for every source s (self first), wait for done[s, p] >= epoch (s a peer), decode s's reduced tiles
   and store them into the output at chunk s.
A program's own slots need no flag: the tiles it reads from recv[me] and gather[me] are the ones it stored there
itself (tiles p, p + P, ... in every phase), so a barrier of its threads orders them.
Every rank decodes the same bytes, so results are bit-identical on all ranks, and equal to
`quantized_all_reduce_reference` (the bulk twin's steps with exchanges as indexing).

Why the buffers need no reset, no barrier and no second half across consecutive calls (each rank's calls are
ordered on its stream, so its launch e + 1 starts after all its programs of launch e have exited):
- recv: rank s stores into any rank's recv at call e + 1 only after its launch e finished, in which each of its
  programs p waited for done[r, p] >= e of every peer r, raised by r's program p after it had read its recv
  tiles of call e (s's own recv was read by that launch e itself). So all of recv of call e has been read,
  whatever the tiling and layout (size, codec) of call e + 1: the flags of phase 3 are the acknowledgement that
  guards phase 1's slots. The same holds for `signatures` (stored in phase 1, read in phase 2). Unless a wait of
  s's phase 3 gave up: r, late, may still be about to read them. So phase 1 also waits (bounded) for released[r]
  >= e, which the last of r's programs through phase 2 (tiles read, or waits given up) raises in every rank (a
  counter of the launch's programs, one acq_rel atomic each: about 0.8 us of GPU time per call on one H200, as
  measured for the step slots below; not yet timed here); its timeout stores nothing into r and raises no flag
  there.
  Without it s's next call overwrote the tiles r was late to reduce: r raised a call mismatch (s's signature of
  call e + 1), or, reading that signature just before it landed, reduced call e + 1's tiles as call e's, silently.
- gather: program p of rank r stores into a peer s's gather[r] (tiles of p) at call e + 1 only after it waited
  for ready[s, p] >= e + 1, raised by s during launch e + 1, after s's launch e (the reader of gather at call
  e) finished; into its own gather after its own launch e. So the flags of phase 2 guard phase 3's slots.
A second half by epoch parity would guard nothing more, so there is none (half the symmetric memory).
Flags hold epochs (never reset, compared with >=); they are laid out [source][max_programs], so calls of any
size use the same flags. A call's epoch comes from the device, not from the host: each rank keeps its last
epoch in `step_ptr`, one slot per program (max_programs); program p reads slot p at its start (+ 1) and, at the
end of the launch that runs phase 3, stores the new epoch into slots p, p + P, p + 2P, ... (P the grid), so
that every slot moves on and a next call of any grid size reads it. No slot is written by two programs or read
by another program of the launch: no atomics, no fences (a last-arriver counter instead, an acq_rel atomic per
program, cost 0.8 us of GPU time per call on one H200). So a launch's arguments are the same from call to call:
a repeated call replays a CUDA graph (`GraphReplays`: ~2.6 us of host time against ~9-10 us through the
binary's launcher; `__call__` finds the graph of a call repeating an earlier one's x, out, codec and mean in one
dictionary lookup: a 32 KiB call's host time fell from ~3 replays' worth to ~2.2, docs/benchmarks.md 2026-11-29),
and a caller may capture the op into a graph of its own. Every wait is bounded: a timeout
records (1, peer, slice) in the error word (slice p < max_programs: peer's scatter of tile set p; max_programs
+ p: peer's reduced tile set p) and later waits stop spinning until the host has read it; `PeerErrors` raises it
naming rank, peer, slice and step. A program whose wait in phase 2 gave up stores nothing and raises no done flag:
a late peer that then reaches phase 3 would otherwise read its gather's tiles of an older call as this one's; it
times out instead (naming this rank, slice max_programs + p). A late peer's reduce still finds its tiles (recv,
above). Once every rank is past the call, the next is exact.

Ranks whose calls differ (size, codec, dtype, mean: a caller's bug) would read each other's slots in another
layout and return wrong sums without an error, so every call has a signature (`_call_signature`: those, the tile
split and flag stride, and the epoch) which travels with the data: stored into each peer before the flag
that releases the tiles, read (as the tiles are) after the flag is seen. A program that finds a peer's signature
unlike its own records error 3 (both signatures: `PeerErrors` names rank, peer and both calls in words) and
stores nothing further: no reduced tiles, no output (x, reduced in place, keeps its values); but it raises its
flags, so the waits of the peers end (its own end at once, as after a timeout: the error word is set), and once
the host has read the error, later calls find their flags and slots as after any call. Every rank compares its
signature with every peer's, so every rank raises. (The epoch word catches a peer already at its next call: where
grids differ, a program whose flag the peer's smaller grid never raises waits until the peer's next call raises
it, or times out.) Not caught: a call that makes only some ranks grow the workspace's buffers (a larger size, a
codec of larger blocks) waits in the buffers' collective allocation, before any kernel, for peers that never
join it; a check there would cost a collective at every new plan, which a caller's graph capture cannot hold.

A call that one rank refuses (`refusal`: an x no codec takes or on another device than the workspace's, an unknown
codec, an out that cannot take the result, more bytes than int32 offsets reach) is still a call there
(peer_flags.RefusedCall): raising alone would leave its peers waiting, and their epochs one ahead of its own for
good. It runs `_refused_call_kernel` (one program, in the phases above): its signature says why ([epoch,
REFUSED_CALL, refusal words]) and goes into every peer before its ready flags, raised for every program (the peers'
grid is not known: `publish_refusal`); then its done flags, in each peer once that peer's ready flag of the call is
seen (a peer late in an older call would take them for that call's); then it waits until every peer's program 0 has
read that signature, which its next call would overwrite, and moves its step slots on. Each peer, checking
signatures, records the refusal (code 5: the lowest refused rank, the same on every rank, before any mismatch,
`same_unrefused_calls`) and stores nothing; its PeerErrors raises PeerRefusedInput naming that rank and why (at the
call's end in the interpreter, within check_every calls on GPUs, as any error). The refused rank raises its own
error at `finish`. The next call, alike on every rank, is exact.
(Where the peers' call grows the buffers, they wait in the allocation, as above.)

On GPUs every program waits on the same-numbered program of every peer's launch, so the grid must be
co-resident: it is capped at what the compiled binary fits on the GPU at once (launch.resident_programs_per_sm
from its registers, warps and shared memory; at 4 warps, 64 MiB of bf16 compiles for sm_90 to 32 (fp16), 38
(q4), 39 (q8), 52 (fp8) and 71 (q6) registers per thread), and at `max_programs` = PROGRAMS_PER_SM (12) per SM,
the flags' stride. The ranks' grids must agree (the tile split is by program): the binary is the same on every
rank (rank is not specialised) as long as the ranks' inputs are alike, in size and, like every
symmetric buffer, in 16-byte alignment (the grid is in the signature: were the grids to differ, every rank
reports the mismatch, those with the larger grid only once their flagless programs' waits have ended, at the
latest after spin_limit polls). In the interpreter (one program at a time) a simulated world runs each
phase on every rank before the next (`run(call, phase, phase)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import PeerBuffer, _Workspace, next_epoch_after
from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, GraphReplays, aligned, resident_programs_per_sm
from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.peer_flags import (DEFAULT_SPIN_LIMIT, SIGNATURE_WORDS, PeerErrors, RefusedCall,
                                           check_spin_limit, consumer_released, describe_foreign,
                                           describe_refused_calls, describe_signatures, foreign_operand,
                                           publish_refusal, recorded_at, release_when_last, same_unrefused_calls,
                                           signal_every_program, signal_peer, signal_ready, signature_of,
                                           store_signature, wait_or_record)
from fused_dlrm.kernels.quant_codecs import (BLOCK, CODECS, NO_FMA, block_values, decode_reference,
                                             encode_blocks, encode_reference, error_bound, kernel_constants,
                                             load_blocks, store_blocks)

# Kernel times at 64 MiB bf16, 2 ranks (2026-11-22, 2x H200, a5789bd), fp16 / q8 / q4 codec, by programs per
# SM, blocks per tile and warps: P2 t128 w4 (the former default) 238 / 246 / 253 us; P4 t64 w4 235 / 199 / 188;
# P4 t32 w4 256 / 220 / 217; P8 t32 w4 237 / 180 / 160; P2 t128 w8 235 / 217 / 208. So tiles of 32 blocks and up
# to 8 programs of 4 warps per SM (fewer where the binary's registers do not fit 8: the grid must be
# co-resident): more programs keep more loads in flight, although a thread then moves 1-4 payload words, in
# narrower accesses (a warp's still cover whole contiguous lines). Smaller messages were not measured.
TILE_BLOCKS = 32
# The grid's cap and, x SMs, the flags' stride (max_programs). 12 rather than 8: the phases of 64 MiB timed one by
# one on one H200 (a simulated world of 2, 2026-11-23): q4 102.7 -> 94.0 us, q8 111.2 -> 100.7; 16 asked for
# ran 12 (the registers' cap) at 97.3 and 103.2.
PROGRAMS_PER_SM = 12
NUM_WARPS = 4
STEP_SLOTS = tl.constexpr(512)  # step slots a program stores at once (4 per thread)


def chunk_blocks_for(numel: int, world: int) -> int:
    """Whole 32-value blocks per rank's chunk (the bulk twin's split); at least one, so that an empty x is a call
    all the same (its padding block travels, its flags rise, its signature of 0 values is compared)."""
    return max(1, -(-numel // (world * BLOCK)))


def out_problem(x: torch.Tensor, out: torch.Tensor | None) -> str | None:
    """Why `out` cannot take an all-reduce of x, or None: it must be contiguous, of x's shape, dtype and device (x
    itself: in place; None: a new tensor)."""
    if out is None or (out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
                       and out.is_contiguous()):
        return None
    return (f"out must be contiguous {x.dtype} {list(x.shape)} on {x.device}, like x; got {out.dtype} "
            f"{list(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")


def check_out(x: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError where `out_problem` finds one."""
    problem = out_problem(x, out)
    if problem is not None:
        raise ValueError(problem)


QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)  # what the codecs encode


def check_quantizable(x: torch.Tensor) -> None:
    """The codecs encode fp32 / fp16 / bf16 values: other dtypes would come back wrong (integers) or fail deep inside."""
    if x.dtype not in QUANTIZABLE:
        raise _not_quantizable(x.dtype)


def _not_quantizable(dtype: torch.dtype) -> TypeError:
    return TypeError(f"a quantized all-reduce takes fp32, fp16 or bf16 tensors, got {dtype} (codec 'nccl' "
                     f"all-reduces any dtype)")


def slot_bytes(numel: int, world: int, codec: str) -> int:
    """Bytes of each of the fused kernel's recv and gather buffers for a call of numel values: world chunks'
    encodings."""
    return world * chunk_blocks_for(numel, world) * CODECS[codec].block_bytes


# Why a rank refuses its fused call (`refusal`): word 0 of its refusal words, which its peers record
# (`describe_refusal`)
NOT_QUANTIZABLE, UNKNOWN_CODEC, UNUSABLE_OUT, TOO_LARGE, FOREIGN_X = 1, 2, 3, 4, 5


def refusal(x: torch.Tensor, codec: str, out: torch.Tensor | None, world: int, device: torch.device
            ) -> tuple[list[int], Exception] | None:
    """Why this rank cannot run a fused call: its refusal words ([reason, values...], for its peers) and the error it
    raises itself; None if it can. device: the workspace buffers' (x on another: `foreign_operand`; an out on
    another device than x's: `out_problem`)."""
    foreign = foreign_operand({"x": x}, device)
    if foreign is not None:
        words, error = foreign
        return [FOREIGN_X] + words, error
    if x.dtype not in QUANTIZABLE:
        return [NOT_QUANTIZABLE, dtype_code(x.dtype)], _not_quantizable(x.dtype)
    if codec not in CODECS:
        return [UNKNOWN_CODEC], ValueError(f"unknown codec {codec!r}: expected one of {tuple(CODECS)}")
    problem = out_problem(x, out)
    if problem is not None:
        return [UNUSABLE_OUT, x.numel(), dtype_code(x.dtype), out.numel(), dtype_code(out.dtype),
                int(out.is_contiguous()), int(out.device == x.device)], ValueError(problem)
    slots = slot_bytes(x.numel(), world, codec)
    if slots >= 2**31:
        return [TOO_LARGE, x.numel(), slots], ValueError(f"{x.numel()} values encode to {slots} bytes: the kernel's "
                                                          f"offsets are int32")
    return None


def describe_refusal(words: list[int]) -> str:
    """A rank's refusal words (`refusal`) in words, as its peers say them."""
    reason, *values = words
    if reason == NOT_QUANTIZABLE:
        return f"its x is {dtype_name(values[0])}, which no codec takes"
    if reason == UNKNOWN_CODEC:  # (its name does not travel: the words are integers)
        return "its codec is none of the fused kernel's"
    if reason == FOREIGN_X:
        return describe_foreign(("x",), values)
    if reason == UNUSABLE_OUT:
        numel, dtype, out_numel, out_dtype, contiguous, same_device = values[:6]
        return (f"its out ({out_numel} {dtype_name(out_dtype)}{'' if contiguous else ', not contiguous'}"
                f"{'' if same_device else ', on another device'}) cannot take the result of its x ({numel} "
                f"{dtype_name(dtype)})")
    return f"its {values[0]} values encode to {values[1]} bytes, past the kernel's int32 offsets"  # TOO_LARGE


# A call's codec as an index here (-1: none of them), so that a mismatch can be named. "none" is "nccl" (both a plain
# all-reduce).
SIGNATURE_CODECS = ("nccl",) + tuple(CODECS)


def call_signature(numel: int, dtype: torch.dtype, codec: str, mean: bool) -> list[int]:
    """[numel, dtype (`dtype_code`), codec, mean] as integers: what the ranks' calls of one all-reduce must agree on
    (the fused kernel's signature adds its epoch and tile split: `_call_signature`)."""
    codec = "nccl" if codec == "none" else codec
    return [numel, dtype_code(dtype), SIGNATURE_CODECS.index(codec) if codec in SIGNATURE_CODECS else -1, int(mean)]


def describe_call(signature: list[int]) -> str:
    """`call_signature` in words: "4096 float32 elements, codec q8" (", mean" with mean; ", into an unusable out"
    where a fifth word, the bulk call's check of its out (`out_problem`), is 1)."""
    numel, dtype, codec, mean = signature[:4]
    codec = SIGNATURE_CODECS[codec] if 0 <= codec < len(SIGNATURE_CODECS) else "unknown"
    return (f"{numel} {dtype_name(dtype)} elements, codec {codec}{', mean' if mean else ''}"
            f"{', into an unusable out' if signature[4:5] == [1] else ''}")


def describe_fused_calls(mine: list[int], theirs: list[int]) -> tuple[str, str]:
    """Two fused calls' signatures (the kernel's `_call_signature`) in words: size, dtype, codec and mean, then the
    grid, flag stride, tile size and step where they differ."""
    return describe_signatures(mine, theirs, lambda signature: describe_call(signature[1:5]),
                               {5: "a grid of {} programs", 6: "flags for {} programs", 7: "tiles of {} blocks"})


def sum_in_rank_order(parts: list[torch.Tensor], mean: bool) -> torch.Tensor:
    """fp32 sum of the decoded parts, added in rank order (then / world with mean): the arithmetic of phase 2."""
    reduced = parts[0].clone()
    for part in parts[1:]:
        reduced += part
    return reduced.div_(len(parts)) if mean else reduced


def quantized_all_reduce_reference(xs: list[torch.Tensor], codec: str, mean: bool = False) -> torch.Tensor:
    """Pure torch: what every rank's fused (and bulk) all-reduce of the world's inputs xs returns."""
    world, numel = len(xs), xs[0].numel()
    cb = chunk_blocks_for(numel, world)
    chunk = cb * BLOCK
    sent = [decode_reference(encode_reference(x, codec, world * cb), codec, world * chunk).view(world, chunk)
            for x in xs]
    reduced = [sum_in_rank_order([sent[s][r] for s in range(world)], mean) for r in range(world)]
    gathered = encode_reference(torch.cat(reduced), codec)  # chunks are whole blocks: the chunks' encodings
    return decode_reference(gathered, codec, numel).view(xs[0].shape).to(xs[0].dtype)


def two_shot_error_bound(xs: list[torch.Tensor], codec: str, mean: bool = False) -> torch.Tensor:
    """fp32 per-element bound on |all-reduce - exact sum (mean)|, in x's shape, with B = quant_codecs.error_bound:
    stage 1's errors sum_r B(x_r), plus stage 2's B(z) on the partial sum z they may have moved (|z| <= |exact| +
    stage 1); with mean both are divided by world (fp32 summation is far inside B); then, for bf16 / fp16 tensors,
    the rounding of that fp32 result to their dtype (`_rounding_bound`: relative 2^-8 / 2^-11). inf where a range
    may be passed: the fp16 codec's (|x_r| or |z| from 65520; z is the mean with mean), whose result there is +-inf
    (or NaN, where infinities of both signs meet), or the result's dtype's."""
    world = len(xs)
    exact = sum(x.float() for x in xs).reshape(-1)  # flat, as B
    first = sum(error_bound(x, codec) for x in xs)
    if mean:
        exact = exact / world
        bound = first / world + error_bound(exact.abs() + first / world, codec)
    else:
        bound = first + error_bound(exact.abs() + first, codec)
    return (bound + _rounding_bound(exact.abs() + bound, xs[0].dtype)).view(xs[0].shape)


def _rounding_bound(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 bound on |y - y.to(dtype)| for fp32 values |y| <= a: 0 for fp32; else half an ulp (relative eps / 2)
    plus half the subnormal step, and inf from the dtype's largest value plus half its ulp (rounded to inf)."""
    if dtype == torch.float32:
        return torch.zeros_like(a)
    info = torch.finfo(dtype)
    overflow = info.max + info.max / (2 - info.eps) * info.eps / 2  # 65520 for fp16
    return torch.where(a >= overflow, torch.inf, a * (info.eps / 2) + info.smallest_normal * info.eps / 2)


@triton.jit
def _encoded(ptrs, peer, num_blocks, WORDS: tl.constexpr):
    """(payload, scales): pointers of peer's recv or gather buffer, which holds an encoding of num_blocks blocks
    (int32 payload [num_blocks, WORDS], then bf16 scales [num_blocks]). Symmetric buffers are 16-byte aligned
    (every rank allocates alike; each plan of `FusedQuantizedAllReduce` checks its own), which the compiler cannot see
    through the pointer table: with the hint, payload rows of 16-byte multiples move as 128-bit vectors."""
    payload = tl.multiple_of(tl.load(ptrs + peer).to(tl.pointer_type(tl.int32)), 16)
    return payload, (payload + num_blocks * WORDS).to(tl.pointer_type(tl.bfloat16))


@triton.jit
def _call_signature(epoch, numel, dtype_code, codec_code, MEAN: tl.constexpr, num_programs, max_programs,
                    ROWS: tl.constexpr):
    """What a peer's call must share with this one (`describe_fused_calls` reads it): the epoch, what fixes the
    slots' layout and what lands in them (numel, dtype: `call_signature`'s codes, which round input and output;
    codec; mean), and the tile split and flag slots (grid, flag stride, tile size)."""
    return signature_of((epoch, numel, dtype_code, codec_code, 1 if MEAN else 0, num_programs, max_programs, ROWS))


@triton.jit(do_not_specialize=["rank", "spin_limit", "first_phase", "last_phase"])
def _refused_call_kernel(signature_ptr, ready_ptrs, done_ptrs, signature_ptrs, released_ptrs, step_ptr, error_ptr,
                         rank, max_programs, spin_limit, first_phase, last_phase, WORLD: tl.constexpr,
                         SLOTS: tl.constexpr):
    """One program: a call this rank refused, in the phases of a call, so that its peers' calls end and the ranks'
    epochs stay in step. 1: its signature (signature_ptr: a RefusedCall's) into every peer, then its ready flags
    there, for every program (`publish_refusal`); 2: its done flags likewise, in each peer once its program 0's
    ready flag of this call is seen (raised after its launch of the call before ended: a peer late in an older call,
    after this rank's wait for it gave up, would take them for that call's and gather tiles never stored); 3: wait
    until every peer's program 0 has raised its done flag: it has read the signature (and recorded the refusal)
    that a next call of this rank would overwrite; then the step slots move on. Its signature goes into a peer once
    that peer is through with the reduce of the call before (`released`, as a call's scatter), and it releases its
    own recv in phase 2 (it reads none of it)."""
    epoch = tl.load(step_ptr, volatile=True) + 1  # every slot holds the epoch of the last call
    ready = tl.load(ready_ptrs + rank).to(tl.pointer_type(tl.int32))
    done = tl.load(done_ptrs + rank).to(tl.pointer_type(tl.int32))
    released = tl.load(released_ptrs + rank).to(tl.pointer_type(tl.int32))
    for k in tl.static_range(1, WORLD):
        peer = (rank + k) % WORLD
        if first_phase <= 0:
            if consumer_released(released, peer, epoch, spin_limit, error_ptr):
                publish_refusal(signature_ptr, epoch, signature_ptrs, 0, ready_ptrs, peer, rank, max_programs, SLOTS)
        if (first_phase <= 1) & (last_phase >= 1):
            if wait_or_record(ready + peer * max_programs, epoch, spin_limit, error_ptr, peer, 0):
                signal_every_program(done_ptrs, peer, rank, max_programs, epoch, SLOTS)
        if last_phase >= 2:
            wait_or_record(done + peer * max_programs, epoch, spin_limit, error_ptr, peer, max_programs)
    if (first_phase <= 1) & (last_phase >= 1):
        signal_ready(released_ptrs, rank, epoch, WORLD)
    if last_phase >= 2:
        p = tl.arange(0, SLOTS)
        tl.store(step_ptr + p, tl.zeros([SLOTS], tl.int32) + epoch, mask=p < max_programs)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest even in the output dtype, as torch's .to(dtype): bf16 by bit arithmetic because
    the interpreter's fp32 -> bf16 cast truncates (fp16's cast rounds, and keeps NaN, on GPUs and there)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # NaN: the add carries a NaN's mantissa into its exponent and sign (0x7FFFFFFF, GPUs' NaN, -> -0.0): a
        # NaN instead (torch's 0x7FC0), as CUDA's __float2bfloat16_rn gives
        bits = tl.where(x != x, 0x7FC0, bits)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


# Values that change from call to call or rank to rank are not specialized (Triton would compile a variant for
# rank == 1, num_programs == 1, ...): fewer compilations. numel is (its divisibility by 16 lets loads be wide vectors).
@triton.jit(do_not_specialize=["chunk_blocks", "rank", "num_programs", "spin_limit", "first_phase", "last_phase"])
def _quantized_all_reduce_kernel(
    x_ptr, out_ptr, numel, chunk_blocks, recv_ptrs, gather_ptrs, ready_ptrs, done_ptrs, error_ptr, step_ptr,
    signature_ptrs, released_ptrs, reduced_ptr, dtype_code, codec_code, rank, num_programs, max_programs, spin_limit,
    first_phase, last_phase, WORLD: tl.constexpr, MEAN: tl.constexpr, KIND: tl.constexpr, QMAX: tl.constexpr,
    OFFSET: tl.constexpr, WORDS: tl.constexpr, LOW: tl.constexpr, ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(step_ptr + pid, volatile=True) + 1  # this call's epoch (module docstring: the step slots)
    tiles = tl.cdiv(chunk_blocks, ROWS)
    i = tl.arange(0, ROWS)
    slots = WORLD * chunk_blocks  # blocks in every recv and gather buffer: [source][chunk_blocks], < 2 GiB
    mine = rank * chunk_blocks  # my first block there
    # This call's signature: stored into every peer beside the data, checked against theirs.
    signature = _call_signature(epoch, numel, dtype_code, codec_code, MEAN, num_programs, max_programs, ROWS)
    valid = epoch > 0  # (true) the peers' calls are mine and their tiles arrived, unless phase 2 finds otherwise
    if first_phase <= 0:  # 1. scatter
        released_here = tl.load(released_ptrs + rank).to(tl.pointer_type(tl.int32))
        for k in tl.static_range(WORLD):
            dest = (rank + 1 + k) % WORLD
            released = epoch > 0  # (true) my own recv: my launch before read it (stream order)
            if k < WORLD - 1:  # a peer: through with my tiles of the call before? (module docstring: recv)
                released = consumer_released(released_here, dest, epoch, spin_limit, error_ptr)
            payload, scales = _encoded(recv_ptrs, dest, slots, WORDS)
            t = tl.where(released, pid, tiles)
            while t < tiles:  # `while`: the interpreter cannot range() from a program id
                rows = t * ROWS + i
                row_mask = rows < chunk_blocks
                idx = block_values(dest * chunk_blocks + rows)
                x = tl.load(x_ptr + idx, mask=(idx < numel) & row_mask[:, None], other=0.0).to(tl.float32)
                codes, scale = encode_blocks(x, KIND, QMAX, OFFSET)
                store_blocks(payload, scales, mine + rows, row_mask, codes, scale, KIND, WORDS, LOW)
                t += num_programs
            if k < WORLD - 1:  # a peer (my own tiles are read by this program: phase 2 needs only a barrier)
                if released:  # (no flag over tiles not stored)
                    store_signature(signature_ptrs, dest, 0, rank, signature)  # released with the tiles by the flag
                    signal_peer(ready_ptrs, dest, rank * max_programs + pid, epoch)
    if (first_phase <= 1) & (last_phase >= 1):  # 2. reduce my chunk
        ready = tl.load(ready_ptrs + rank).to(tl.pointer_type(tl.int32))
        for k in tl.static_range(1, WORLD):
            peer = (rank + k) % WORLD
            valid &= wait_or_record(ready + peer * max_programs + pid, epoch, spin_limit, error_ptr, peer, pid)
        arrived = valid
        tl.debug_barrier()  # my own tiles, stored by this program's threads in phase 1
        if valid:  # every peer's flag is up: read their signatures as their data, behind it
            signatures = tl.load(signature_ptrs + rank).to(tl.pointer_type(tl.int64))
            valid &= same_unrefused_calls(signatures, rank, signature, error_ptr, pid, epoch, WORLD)
        payload, scales = _encoded(recv_ptrs, rank, slots, WORDS)
        # A failed call reduces nothing (its peers' tiles may be of another layout). Its done flags say "my reduced
        # tiles are in your gather" or, where every peer's flag was seen, "the call failed, as your own check of our
        # signatures tells you": so they rise then (the peers' waits end), but not after a wait gave up: a late
        # peer, finding them, would read its gather's tiles of an older call as this one's (it times out instead).
        t = tl.where(valid, pid, tiles)
        while t < tiles:
            rows = t * ROWS + i
            row_mask = rows < chunk_blocks
            acc = load_blocks(payload, scales, rows, row_mask, KIND, OFFSET, WORDS, LOW)
            for s in tl.static_range(1, WORLD):  # fp32, in rank order (the bulk twin's order)
                acc += load_blocks(payload, scales, s * chunk_blocks + rows, row_mask, KIND, OFFSET, WORDS, LOW)
            if MEAN:
                acc = tl.math.div_rn(acc, tl.full(acc.shape, WORLD, tl.float32))
            codes, scale = encode_blocks(acc, KIND, QMAX, OFFSET)
            for k in tl.static_range(WORLD):
                gather, gather_scales = _encoded(gather_ptrs, (rank + 1 + k) % WORLD, slots, WORDS)
                store_blocks(gather, gather_scales, mine + rows, row_mask, codes, scale, KIND, WORDS, LOW)
            t += num_programs
        if arrived:
            for k in tl.static_range(WORLD - 1):  # the peers
                signal_peer(done_ptrs, (rank + 1 + k) % WORLD, rank * max_programs + pid, epoch)
        # The last program through (its tiles read, or its waits given up) tells every peer that my recv of this
        # call is theirs again (their next call's scatter waits for it).
        release_when_last(reduced_ptr, released_ptrs, rank, epoch, WORLD)
    if last_phase >= 2:  # 3. gather every reduced chunk into the output
        # A failed call leaves the output as it was (x, reduced in place, keeps its values): phase 2's verdict, or,
        # launched apart from it, an error the error word holds for this call.
        valid &= recorded_at(error_ptr, epoch) == 0
        done = tl.load(done_ptrs + rank).to(tl.pointer_type(tl.int32))
        payload, scales = _encoded(gather_ptrs, rank, slots, WORDS)
        tl.debug_barrier()  # my own reduced tiles, stored by this program's threads in phase 2
        for k in tl.static_range(WORLD):
            src = (rank + k) % WORLD
            arrived = valid
            if k > 0:  # (a failed call's wait looks once: its error word is set)
                arrived &= wait_or_record(done + src * max_programs + pid, epoch, spin_limit, error_ptr, src,
                                          max_programs + pid)
            t = tl.where(arrived, pid, tiles)
            while t < tiles:
                rows = t * ROWS + i
                row_mask = rows < chunk_blocks
                x = load_blocks(payload, scales, src * chunk_blocks + rows, row_mask, KIND, OFFSET, WORDS, LOW)
                idx = block_values(src * chunk_blocks + rows)
                out = _round_to(x, out_ptr.dtype.element_ty)
                tl.store(out_ptr + idx, out, mask=(idx < numel) & row_mask[:, None])
                t += num_programs
        # The call is over: this program's step slots (pid, pid + P, ...) move on to its epoch.
        s = 0
        while s * tl.num_programs(0) < max_programs:
            my_slots = pid + (s + tl.arange(0, STEP_SLOTS)) * tl.num_programs(0)
            tl.store(step_ptr + my_slots, tl.zeros((STEP_SLOTS,), tl.int32) + epoch, mask=my_slots < max_programs)
            s += STEP_SLOTS


@dataclass
class Plan:
    """What every call of one key (FusedQuantizedAllReduce._key: size, dtype, codec, mean, alignment) does alike:
    its buffers, tile split, grid and kernel arguments, computed once."""
    key: tuple
    num_programs: int  # the grid
    recv: PeerBuffer
    gather: PeerBuffer
    args: Arguments  # filled per call with x, out and the phases
    replays: GraphReplays  # graphs of this plan's calls (they point into its buffers), by x's and out's addresses


@dataclass
class FusedCall:
    """One all-reduce in flight: its input, output and plan; a refused one (`refusal`) has no plan but a RefusedCall
    (the error it raises, its signature for the peers)."""
    x: torch.Tensor
    out: torch.Tensor | None
    plan: Plan | None
    refused: RefusedCall | None = None


class FusedQuantizedAllReduce:
    """The fused all-reduce of one workspace (one process group): its symmetric slots, flags and error word.

    Every rank must make the same calls in the same order with the same sizes (allocation is collective and the
    flags carry a per-call epoch). `max_programs`: the grid cap and the flags' stride (`max_programs_for` on
    GPUs; fixed, as the flags cannot grow); on GPUs the grid is also capped at what the call's compiled binary
    fits co-resident (see the module docstring). `tile_blocks`: blocks per tile (a power of two; small ones let
    the interpreter tests cover many tiles).

    Host time per call is kept small (the op is latency-bound at small sizes): what depends only on the call's
    key is computed once into a `Plan`, and GPUs launch the plan's compiled binary (kernels/launch.py), or replay
    the graph of an earlier call with the same x and out (the epoch is on the device). Plans are dropped, with
    their graphs, when a larger message grows the symmetric buffers they point into.
    """

    def __init__(self, workspace: _Workspace, max_programs: int, spin_limit: int = DEFAULT_SPIN_LIMIT,
                 tile_blocks: int = TILE_BLOCKS):
        check_spin_limit(spin_limit, "spin_limit")
        self.ws, self.max_programs, self.spin_limit, self.tile_blocks = workspace, max_programs, spin_limit, tile_blocks
        self.rank, self.world = workspace.rank, workspace.world_size
        self.errors = PeerErrors(workspace.device, self.rank,
                                 f"fused quantized all-reduce (slices >= {max_programs}: all-gather)",
                                 describe_calls=describe_fused_calls,
                                 describe_refused=describe_refused_calls(self.rank, describe_refusal))
        flags = self.world * max_programs
        self.ready = workspace.buffer("qar_ready", flags, torch.int32)
        self.done = workspace.buffer("qar_done", flags, torch.int32)
        # every source's signature of its latest call, beside the flags (the kernel's `same_unrefused_calls`)
        self.signatures = workspace.buffer("qar_signatures", self.world * SIGNATURE_WORDS.value, torch.int64)
        # released[r]: the last call whose reduce rank r is through with (module docstring: recv), and the count
        # of this rank's programs through it in the current launch (the last one raises released in every rank)
        self.released = workspace.buffer("qar_reduce_ack", self.world, torch.int32)
        self.reduced = torch.zeros(1, dtype=torch.int32, device=workspace.device)
        self.step = torch.zeros(max_programs, dtype=torch.int32, device=workspace.device)  # the kernel's epochs
        self.calls = 0  # the epochs' count on the host (`_count_call`)
        self._plans: dict[tuple, Plan] = {}
        self._repeats: dict[tuple, torch.cuda.CUDAGraph] = {}  # __call__'s graphs by _repeat_key (GPUs only)
        self._launches = CompiledLaunches(_quantized_all_reduce_kernel)
        # NO_FMA: no fused multiply-add (of decode and sum, of the encode's scaling), so the arithmetic equals the
        # bulk twin's.
        self.options = {} if self._launches.interpret else dict(num_warps=NUM_WARPS, **NO_FMA)

    def _count_call(self) -> None:
        """Number a call on the host as the kernel does on the device (its int32 `step`, which graphs replay):
        past 2**31 - 1 the device's would wrap, and a wrapped epoch takes the peers' old flags for its own (a
        silent stale read). Refused there instead (`next_epoch_after`): every rank makes the same calls, so all
        refuse alike."""
        self.calls = next_epoch_after(self.calls, f"fused quantized all-reduce: rank {self.rank}: this op")

    @staticmethod
    def _key(x: torch.Tensor, out: torch.Tensor, codec: str, mean: bool) -> tuple:
        """What the plan and the compiled kernel's specialisation follow from: x's size (numel is specialised),
        the dtype of x and out, the codec and mean (constexprs), and the 16-byte alignment of x and out."""
        return x.numel(), x.dtype, codec, mean, aligned(x), aligned(out)

    def start(self, x: torch.Tensor, codec: str, mean: bool = False, out: torch.Tensor | None = None) -> FusedCall:
        """Plan (and allocate collectively) on a key's first call, number the call; nothing is launched yet.
        out: where the result goes (contiguous, x's shape and dtype; x itself for an in-place all-reduce: every
        program reads and writes only its own tiles, its reads first); None: a new tensor (its allocation is
        ~4 us of host time, a quarter of a small call's). A call this rank refuses (`refusal`: x's dtype, the codec,
        out, the size) is a call all the same, which raises at `finish` (see the module docstring)."""
        self.errors.check()
        self._count_call()  # a refused call too: it takes its epoch
        refused = refusal(x, codec, out, self.world, self.ready.local.device)
        if refused is not None:
            return FusedCall(x, out, None, RefusedCall.of(*refused, self.ws.device))
        x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        key = self._key(x, out, codec, mean)
        plan = self._plans.get(key) or self._plan(key, x, out, codec, mean)
        return FusedCall(x, out, plan)

    def _plan(self, key: tuple, x: torch.Tensor, out: torch.Tensor, codec: str, mean: bool) -> Plan:
        numel = x.numel()
        cb = chunk_blocks_for(numel, self.world)
        slots = slot_bytes(numel, self.world, codec)  # < 2**31 (`refusal`)
        recv, gather = self.ws.buffer("qar_recv", slots, torch.uint8), self.ws.buffer("qar_gather", slots, torch.uint8)
        if (recv.local.data_ptr() | gather.local.data_ptr()) % 16:  # the kernel's vector accesses rely on it
            raise RuntimeError("the quantized all-reduce needs 16-byte aligned symmetric buffers")
        # Plans made before a buffer grew point into the old one: drop them (their keys plan anew). The repeats may
        # hold their graphs: forget them all (planning is rare; a repeat finds its graph again at its next call).
        self._plans = {k: p for k, p in self._plans.items() if p.recv is recv and p.gather is gather}
        self._repeats.clear()
        per_call = ("x_ptr", "out_ptr", "first_phase", "last_phase")
        fixed = dict(numel=numel, chunk_blocks=cb, recv_ptrs=recv.peer_ptrs, gather_ptrs=gather.peer_ptrs,
                     ready_ptrs=self.ready.peer_ptrs, done_ptrs=self.done.peer_ptrs, error_ptr=self.errors.word,
                     step_ptr=self.step, signature_ptrs=self.signatures.peer_ptrs,
                     released_ptrs=self.released.peer_ptrs, reduced_ptr=self.reduced,
                     rank=self.rank, num_programs=self.max_programs, max_programs=self.max_programs,
                     spin_limit=self.spin_limit, WORLD=self.world, MEAN=mean, ROWS=self.tile_blocks,
                     **kernel_constants(CODECS[codec]))
        _, fixed["dtype_code"], fixed["codec_code"], _ = call_signature(numel, x.dtype, codec, mean)
        programs = min(self.max_programs, triton.cdiv(cb, self.tile_blocks))
        # The binary first (num_programs is not specialised: any value compiles it), then the grid it allows.
        binary = self._launches.compiled(key, (programs, 1, 1),
                                         Arguments(_quantized_all_reduce_kernel, per_call, **fixed)(x, out, 0, 2),
                                         self.options)
        if binary is not None:
            per_sm = resident_programs_per_sm(binary.n_regs, binary.metadata.num_warps, binary.metadata.shared)
            programs = min(programs, per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
        fixed["num_programs"] = programs
        args = Arguments(_quantized_all_reduce_kernel, per_call, **fixed)
        plan = self._plans[key] = Plan(key, programs, recv, gather, args, GraphReplays())
        return plan

    def run(self, call: FusedCall, first_phase: int = 0, last_phase: int = 2) -> None:
        """Launch phases first_phase..last_phase of the call (all three on GPUs: one launch, or its graph)."""
        if call.refused is not None:
            self._launch_refused(call.refused.signature, first_phase, last_phase)
        elif self._launches.interpret or (first_phase, last_phase) != (0, 2):
            self._launch(call, first_phase, last_phase)
        else:
            call.plan.replays((call.x.data_ptr(), call.out.data_ptr()), lambda: self._launch(call, 0, 2))

    def _launch(self, call: FusedCall, first_phase: int, last_phase: int) -> None:
        plan = call.plan
        self._launches(plan.key, (plan.num_programs, 1, 1), plan.args(call.x, call.out, first_phase, last_phase),
                       self.options)

    def _launch_refused(self, signature: torch.Tensor, first_phase: int, last_phase: int) -> None:
        _refused_call_kernel[(1,)](signature, self.ready.peer_ptrs, self.done.peer_ptrs, self.signatures.peer_ptrs,
                                   self.released.peer_ptrs, self.step, self.errors.word, self.rank, self.max_programs,
                                   self.spin_limit, first_phase, last_phase, WORLD=self.world,
                                   SLOTS=triton.next_power_of_2(self.max_programs))

    def finish(self, call: FusedCall) -> torch.Tensor:
        """The call's result (raises at once on the CPU, at a later call on GPUs, if a wait timed out, or a peer
        refused its call); a call this rank refused raises its error here."""
        if call.refused is not None:
            raise call.refused.error
        self.errors.after_wait()
        return call.out

    def __call__(self, x: torch.Tensor, codec: str, mean: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """start, run and finish in one; a call that repeats an earlier one (same x and out tensors' addresses,
        shapes, dtypes and contiguity, same codec and mean) replays that call's graph directly (GPUs)."""
        repeat = None if self._launches.interpret else self._repeat_key(x, out, codec, mean)  # no graphs there
        graph = self._repeats.get(repeat)
        if graph is not None and not torch.cuda.is_current_stream_capturing():
            self.errors.check()
            self._count_call()
            graph.replay()
            self.errors.after_wait()
            return out
        call = self.start(x, codec, mean, out)
        self.run(call)
        graph = None if repeat is None or call.plan is None else call.plan.replays.graph(repeat[:2])
        if graph is not None:  # captured at this call or an earlier one: from now on it is replayed directly
            self._repeats[repeat] = graph
        return self.finish(call)

    @staticmethod
    def _repeat_key(x: torch.Tensor, out: torch.Tensor | None, codec: str, mean: bool) -> tuple | None:
        """What a call's graph is valid for, starting with the addresses that key it in its plan's GraphReplays;
        None for a call that makes its output (a new address every time) or reads a non-contiguous x (copied)."""
        if out is None or not (x.is_contiguous() and out.is_contiguous()):
            return None
        return x.data_ptr(), out.data_ptr(), x.shape, out.shape, x.dtype, out.dtype, codec, mean


def max_programs_for(device: torch.device) -> int:
    """`max_programs` on a GPU: PROGRAMS_PER_SM per SM (the same on every rank: the tile split must agree)."""
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
