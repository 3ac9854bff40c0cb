"""GEMV/GEMM + AllReduce in one persistent launch (row-parallel linear: decode, prefill and training).

out[M, N] = sum over ranks r of x_r[M, K_r] @ w_r[K_r, N], fp16/bf16 in, fp32 accumulation. The output is cut
into tiles of [BLOCK_M, BLOCK_N], numbered row of tiles by row of tiles (tile t: M tile t // n_tiles, N tile
t % n_tiles): up to 64 rows are one row of tiles (BLOCK_M: M rounded up to a power of two, at least 16), more
rows are cut into rows of larger tiles (the FEW_ROWS and MANY_ROWS tilings). Each tile's K is cut into `split_k`
chunks so that a GEMV has enough (tile, chunk) work units to fill the GPU. Two algorithms, one launch each:

two-shot: rank d owns the contiguous range of tiles [d * T, (d + 1) * T), T = cdiv(tiles, world). Three phases
per program:
1. produce (zero-copy reduce-scatter): the fp32 partial product of every unit, stored straight into the owner's
   receive slot [source rank, K chunk, tile]. Owners are walked remote first, rotated by rank, the local rank
   last; program p takes the units p, p + P, ... of each owner and then raises its flag (source rank, p) there.
2. reduce + all-gather: for each owned tile, wait for the flags of exactly the programs that produced its units,
   sum the partials in a fixed order (source rank, then K chunk) in fp32, and store the rounded result into every
   rank's output (remote first); then raise flag (owner rank, p) in every rank (not where a wait gave up: below).
3. wait: program p polls the output flags (owner, p) of every owner; when the launch ends the output is complete.
one-shot: every rank receives every unit's partial (produce stores each unit into every rank's slot, then raises
its flag in every rank) and reduces all tiles itself into its own output: one round of flags instead of two, and
no output stores to peers, for (world - 1) times the partials pushed. `algorithm="auto"` takes it while a rank
pushes at most ONE_SHOT_MAX_BYTES (every shape of issue 5's benchmark on 2 ranks), where a call is bound by
reading the weight and by flag latency rather than by bytes over the links.
Either way the fixed order makes the result bit-identical on every rank.
reduce-scatter form (`reduce_scatter`, the sequence-parallel linears' collective): two-shot without the all-gather.
Rank d owns the tiles of its band of output rows [d, d + 1) * M / world (tiled band by band, a band's last row of
tiles cut at its end), reduces them into its own [M / world, N] output, and raises no output flags (the wait
phase has nothing to wait for).

Programs wait for flags raised by other programs of the same launch, here and on peers: the grid must be
co-resident. A plan of more programs than SMs bounds the registers per thread (ptxas' maxnreg,
`launch.registers_per_thread`: 128 for FEW_ROWS's PROGRAMS_PER_SM = 2 of 8 warps): unbounded, ptxas took 162-183
for FEW_ROWS's tiles since the calls' signatures (06ff54d; 143-194 at BLOCK_M 64 before), 175-190 with the released
ranks' mask (buffers, below), one program per SM, and a grid of two per SM was not co-resident (sm_90 builds of the
launches' specialisation, counted with cuobjdump; bounded: 128, 8 bytes spilled at BLOCK_M 64; docs/benchmarks.md,
2026-12-05). Their shared memory fits two per SM (5 stages at BLOCK_M 16: 80 KiB; 3 stages
above: 96 KiB at BLOCK_M 64); MANY_ROWS runs one per SM. Were the grid not
co-resident all the same (e.g. a larger `programs_per_sm` or `num_stages` given to the constructor for a sweep),
the waits would time out and raise, not hang. The Triton interpreter runs programs one after another, so a
simulated world launches the three phases separately (`PHASES`), every rank's phase before the next phase.

Buffers (symmetric, double-buffered by epoch parity): a rank can only start call e + 2 once its call e + 1 has
seen a flag of call e + 1 from every peer (two-shot: the output flags; one-shot and reduce-scatter: the partials'
flags, as it reduces tiles from every rank), i.e. every peer has started call e + 1 and so finished reading the
partials of call e; so the half that call e + 2 overwrites is no longer read. (So every epoch is a launched
call that waits so: a refused one too, below.) Unless a wait of call e + 1 gave up: a late peer may still be about
to reduce call e. So the last of a rank's programs through its reduce of call e (partials and signatures read, or
waits given up: a counter, one acq_rel atomic per program) raises released[rank] = e in every rank, and each
program of call e + 2 first polls released[peer] >= e for every peer (`_released_ranks`; where no wait gave up,
once: the flag rose before that peer's flags of call e + 1); only those it has seen get its partials, its signature
and its flag (one-shot: every peer, as every unit goes to every rank). A timeout records (2, peer, step e) and
stores nothing there (the peer times out naming this rank). Without it, call e + 2 overwrote the partials the late
peer had yet to reduce: it raised a call mismatch (the signature of step e + 2) or, reading the signature just
before it landed, reduced call e + 2's partials as call e's, silently. The returned output is a view of symmetric
memory, valid until the call after next (later stores to it come from call e + 2). Flags carry the epoch, are
never reset and are compared with `>=`; a wait that times out records (1, peer, slice) in the error word, which
`PeerErrors` raises on the host as PeerWaitTimeout (slice: the tile being reduced, -1 for a program that owns
none (below), or in the wait phase the program whose output flag is missing). A program whose wait for a partial
gave up stores no tile from then on and raises no output flag: a late peer's output half still holds its call
before last (valid until it begins this one), and the late peer, finding the flag, would take the tiles there as
this call's; it times out instead, naming this rank and the program. Once every rank is past the call, the next is
exact. (One-shot and reduce-scatter: the late peer reduces its tiles itself, from partials that are there.)

Ranks whose calls differ (M, N, K, dtype, form, or the tiles, K split and grid their ops plan: a caller's bug)
would sum slots of another layout without an error, so every call has a signature (`_call_signature`) that
travels with the partials: each producing program stores it into every rank it sends partials to, in the half of
the signature buffers of the epoch's parity (guarded as the receive slots), before the flag that releases them;
each reducing program reads every peer's once per call, behind the flags of its first tile, or, owning no tile,
behind its peers' flags of its own program number (after raising its own flags). One unlike its own records error
3 (`PeerErrors` names rank, peer and both calls in words), so every rank raises; the call's output is then not
defined, and the flags, raised as after any call, leave the next call exact. (A grid larger than a peer's has
programs whose flags the peer never raises: those give up after spin_limit polls, by when the others have
recorded the mismatch.) An empty call (M = 0) is a call too: it stores no tile and asks for no buffer, but its
programs, the largest grid's, raise their flags, and its program 0 waits for each peer's program 0 (every grid has
one) and compares signatures; skipped, a rank's calls would pair with its peers' one call late, and a call of rows
alike would read the partials of another step unseen. A call that makes only some ranks grow the symmetric
buffers (a larger shape) stops before any kernel: those ranks wait for the others' requests before the collective
allocation, a bounded wait that raises AllocationTimeout naming the ranks that never asked
(dist/symmetric.agree_on_allocation); a rank that asks later raises it too.

A call that one rank refuses (`refusal`: operands on another device than the workspace's (`foreign_operand`: the
kernel would read another GPU's memory; the device is in a plan's key), or that are no x [M, K] and w [K, N] of one
dtype, fp16 or bf16; a reduce-scatter's M not a multiple of the world size; buffers past int32 offsets: what each
rank's own x and w decide) is still a call there (peer_flags.RefusedCall): raising alone would leave its peers
waiting out their bound, and its epochs one behind theirs for every later call. It runs `_refused_call_kernel` (one
program): its signature says why ([epoch, REFUSED_CALL, refusal words]) and goes into every peer's half of the
epoch, then its ready flags there for every program (the peers' grid is not known), so the peers' waits end; then it
waits for a ready flag of the call from every peer, as a call that runs does (the guard of the halves above), and
raises its done flags for every program in each peer once that peer's is seen (a peer late in an older call would
take them for that call's). Each peer, comparing calls, records the refusal (code 5: the lowest refused rank, the
same on every rank, before any mismatch) and raises PeerRefusedInput naming that rank and why (its output not
defined); the refused rank raises its own ValueError at `output`. The next call, alike on every rank, is exact. (A
peer whose call would grow the buffers waits in the allocation, as above, for the refusing rank, which asks for
nothing.) What the op's construction fixes (algorithm, transport, spin bound, tiles) is refused there, before any
call.

`gemm_allreduce_reference` is the pure-torch definition; `gemm_allreduce_bulk` the bulk twin (matmul, then
torch.distributed.all_reduce); `gemm_reduce_scatter_reference` / `_bulk` the same for the reduce-scatter form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import PeerBuffer, _Workspace
from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.launch import Arguments, CompiledLaunches, aligned, registers_per_thread
from fused_dlrm.kernels.peer_flags import (DEFAULT_SPIN_LIMIT, SIGNATURE_WORDS, TENSOR_WORDS, PeerErrors, RefusedCall,
                                           check_spin_limit, describe_foreign, describe_refused_calls,
                                           describe_signatures, describe_tensor, foreign_operand, publish_refusal,
                                           release_when_last, released_at_least, same_unrefused_calls,
                                           signal_every_program, signal_peer, signal_ready, signature_of,
                                           store_signature, tensor_words, wait_or_record)

PRODUCE, REDUCE, WAIT = 1, 2, 4  # the phases of a launch (PHASES is their sum)
ALL_PHASES = PRODUCE | REDUCE | WAIT
PROGRAMS_PER_SM = 2
ALGORITHMS = ("auto", "one_shot", "two_shot")
ONE_SHOT_MAX_BYTES = 8 << 20  # auto: one-shot while the partials a rank pushes to its peers stay below this
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def gemm_allreduce_reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
    """sum_r xs[r] @ ws[r] in float64."""
    return sum(x.double() @ w.double() for x, w in zip(xs, ws))


def gemm_allreduce_bulk(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The bulk twin: the local partial product, then an all-reduce (NCCL on GPUs, gloo on the CPU)."""
    out = x @ w
    dist.all_reduce(out, group=group)
    return out


def gemm_reduce_scatter_reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank r's part of the reduce-scatter form: rows [r, r + 1) * M / world of sum_r xs[r] @ ws[r], float64."""
    return list(gemm_allreduce_reference(xs, ws).chunk(len(xs)))


def gemm_reduce_scatter_bulk(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None
                             ) -> torch.Tensor:
    """The reduce-scatter form's bulk twin: the local partial product, then reduce_scatter_tensor over its rows."""
    out = x @ w
    band = out.new_empty(out.shape[0] // dist.get_world_size(group), out.shape[1])
    dist.reduce_scatter_tensor(band, out, group=group)
    return band


@triton.jit
def _tile_place(tile, n_tiles, tiles_per_rank, band_rows, M, BLOCK_M: tl.constexpr, SCATTER: tl.constexpr):
    """(first row, end of its rows, N tile) of output tile `tile`. All-reduce: the tiles of [M, N] row of tiles by
    row of tiles. Reduce-scatter: owner d's tiles_per_rank tiles cover its band of rows [d, d + 1) * band_rows,
    row of tiles by row of tiles, the last one cut at the band's end."""
    if SCATTER:
        owner = tile // tiles_per_rank
        j = tile % tiles_per_rank
        first = owner * band_rows + (j // n_tiles) * BLOCK_M
        end = (owner + 1) * band_rows
        n_tile = j % n_tiles
    else:
        first = (tile // n_tiles) * BLOCK_M
        end = M
        n_tile = tile % n_tiles
    return first, end, n_tile


FORMS = ("all-reduce, two-shot", "all-reduce, one-shot", "reduce-scatter")  # a signature's form, in words


@triton.jit
def _call_signature(epoch, M, N, K, dtype_code, ONE_SHOT: tl.constexpr, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, split_k, num_programs, flag_stride):
    """What a peer's call must share with this one (`describe_calls` reads it): the epoch, the shapes and dtype
    (x [M, K], w [K, N]), the form (FORMS' index), and what lays out the receive slots, outputs and flags: the
    tiles, K chunks, grid and flag stride. (BLOCK_K is not in it: a rank's K chunks are its own sums.)"""
    form = 2 if SCATTER else (1 if ONE_SHOT else 0)
    return signature_of((epoch, M, N, K, dtype_code, form, BLOCK_M, BLOCK_N, split_k, num_programs, flag_stride))


def describe_calls(mine: list[int], theirs: list[int]) -> tuple[str, str]:
    """Two calls' signatures (`_call_signature`) in words: "x [5, 40] @ w [40, 50] bfloat16, all-reduce, two-shot",
    then the tiles, K chunks, grid, flag stride and step where they differ."""
    def call(signature: list[int]) -> str:
        _, m, n, k, dtype, form = signature[:6]
        return f"x [{m}, {k}] @ w [{k}, {n}] {dtype_name(dtype)}, {FORMS[form]}"

    return describe_signatures(mine, theirs, call, {6: "tiles of {} rows", 7: "tiles of {} columns",
                                                    8: "K split in {}", 9: "a grid of {} programs",
                                                    10: "flags for {} programs"})


# Why a rank refuses its call (`GemmAllReduce._plan`): word 0 of its refusal words, which its peers name
# (`describe_refusal`)
NOT_OPERANDS, UNEVEN_BANDS, TOO_LARGE, FOREIGN_OPERAND = 1, 2, 3, 4
OPERANDS = ("x", "w")  # a call's tensors, as `foreign_operand`'s words name them


def refusal(x: torch.Tensor, w: torch.Tensor, scatter: bool, world: int, device: torch.device
            ) -> tuple[list[int], ValueError] | None:
    """Why this rank cannot run a call on x and w whatever its tiles: its refusal words ([reason, values...], for its
    peers) and the error it raises itself; None if it can. device: the workspace buffers'. (Buffers past int32
    offsets depend on the tiles: `GemmAllReduce._plan`.)"""
    foreign = foreign_operand(dict(zip(OPERANDS, (x, w))), device)
    if foreign is not None:
        words, error = foreign
        return [FOREIGN_OPERAND] + words, error
    if (x.dim() != 2 or w.dim() != 2 or min(*w.shape) < 1 or w.shape[0] != x.shape[1]
            or x.dtype != w.dtype or x.dtype not in (torch.float16, torch.bfloat16)):
        return [NOT_OPERANDS] + tensor_words(x) + tensor_words(w), ValueError(
            f"expected x [M, K] and w [K, N] (K, N >= 1) of one dtype, fp16 or bf16; got {tuple(x.shape)} {x.dtype} "
            f"and {tuple(w.shape)} {w.dtype}")
    if scatter and x.shape[0] % world:
        return [UNEVEN_BANDS, x.shape[0], world], ValueError(
            f"a reduce-scatter cuts M={x.shape[0]} rows into {world} equal bands: M must be a multiple of the world "
            "size")
    return None


def too_large(x: torch.Tensor, w: torch.Tensor) -> tuple[list[int], ValueError]:
    """The refusal of a call whose buffers' halves would pass int32 offsets."""
    (m, k), n = x.shape, w.shape[1]
    return [TOO_LARGE, m, k, n], ValueError(f"a call of x {tuple(x.shape)} and w {tuple(w.shape)} needs buffers of "
                                            "2^31 elements or more per half: split it")


def describe_refusal(words: list[int]) -> str:
    """A rank's refusal words (`refusal`, `too_large`) in words, as its peers say them."""
    reason, *values = words
    if reason == NOT_OPERANDS:
        x, w = values[:TENSOR_WORDS], values[TENSOR_WORDS:]
        return (f"its x {describe_tensor(x)} and w {describe_tensor(w)} are not x [M, K] and w [K, N] (K, N >= 1) "
                "of one dtype, fp16 or bf16")
    if reason == FOREIGN_OPERAND:
        return describe_foreign(OPERANDS, values)
    if reason == UNEVEN_BANDS:
        m, world = values[:2]
        return f"its reduce-scatter cuts M={m} rows into {world} equal bands (M must be a multiple of the world size)"
    m, k, n = values[:3]  # TOO_LARGE
    return f"its x [{m}, {k}] @ w [{k}, {n}] needs buffers of 2^31 elements or more per half"


@triton.jit
def _partial_tile(x_ptr, w_ptr, stride_xm, stride_xk, stride_wk, stride_wn, first_row, row_end, n_tile, N, K,
                  chunk, k_chunk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  K_TILES: tl.constexpr, DOT_FP32: tl.constexpr):
    """This rank's [BLOCK_M, BLOCK_N] fp32 partial product of rows [first_row, row_end) (at most BLOCK_M) and N
    tile `n_tile` over K chunk `chunk`."""
    rows = first_row + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = chunk * k_chunk
    k_end = tl.minimum(k_begin + k_chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(K_TILES):
        k = k_begin + i * BLOCK_K + ks
        k_mask = k < k_end
        # int64 offsets: M*K or K*N may pass 2^31, in either layout (a Linear's weight.t() has stride_wn = K)
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :].to(tl.int64) * stride_xk,
                    mask=(rows < row_end)[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + k[:, None].to(tl.int64) * stride_wk + n[None, :].to(tl.int64) * stride_wn,
                    mask=k_mask[:, None] & (n[None, :] < N), other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def _released_ranks(released_ptrs, rank, epoch, spin_limit, error_ptr, WORLD: tl.constexpr):
    """The ranks that may take call `epoch`'s partials and signature (bit d: rank d): a peer once it is through with
    its reduce of the call before last, whose half of the receive slots and signatures they go into (bounded:
    `released_at_least`; a timeout is recorded), this rank at once (its launch before last read them: stream
    order). (The module docstring: buffers.)"""
    tl.static_assert(WORLD <= 32, "a rank's bit in an int32")
    flags = tl.load(released_ptrs + rank).to(tl.pointer_type(tl.int32))
    released = 1 << rank
    for k in tl.static_range(1, WORLD):
        dest = (rank + k) % WORLD
        if released_at_least(flags, dest, epoch - 2, epoch, spin_limit, error_ptr):
            released |= 1 << dest
    return released


@triton.jit
def _send_signature(signature_ptrs, ready_ptrs, dest, signature_half, rank, signature, flag_stride, epoch):
    """After this program's partials into dest: this call's signature beside them, then its ready flag there, which
    releases both."""
    store_signature(signature_ptrs, dest, signature_half, rank, signature)
    signal_peer(ready_ptrs, dest, rank * flag_stride + tl.program_id(0), epoch)


# One compiled variant for every epoch; the halves' sizes follow the symmetric buffers, which a larger call grows
# under the same plan key: not specialised, so the key's cached binary stays valid for them.
@triton.jit(do_not_specialize=["epoch", "recv_half", "out_half"])
def _gemm_allreduce_kernel(
    x_ptr, w_ptr, stride_xm, stride_xk, stride_wk, stride_wn,
    recv_ptrs, out_ptrs, ready_ptrs, done_ptrs, signature_ptrs, released_ptrs, error_ptr, reduced_ptr,
    rank, epoch, M, N, K, dtype_code, recv_half, out_half, num_tiles, n_tiles, tiles_per_rank, band_rows, slot_rows,
    split_k, k_chunk, num_programs, flag_stride, spin_limit,
    WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT_FP32: tl.constexpr, PHASES: tl.constexpr,
    ONE_SHOT: tl.constexpr, SCATTER: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    slot_size = slot_rows * BLOCK_N  # one partial tile in a receive slot: [slot_rows <= BLOCK_M, BLOCK_N] fp32
    parity = epoch % 2
    # This call's signature: stored beside the partials (released by their flags) into every rank they go to, in
    # the half of the signature buffers of this epoch's parity (guarded as the receive slots are); compared with
    # every peer's once per program (the module docstring).
    signature = _call_signature(epoch, M, N, K, dtype_code, ONE_SHOT, SCATTER, BLOCK_M, BLOCK_N, split_k,
                                num_programs, flag_stride)
    signature_half = parity * WORLD * SIGNATURE_WORDS
    signatures = tl.load(signature_ptrs + rank).to(tl.pointer_type(tl.int64)) + signature_half  # peers' here

    if PHASES & 1:  # produce: partial tiles into the receive slots of the ranks that reduce them
        # Only into ranks through with their reduce of my call before last (a late peer may not be): none stored
        # into the others, and no flag raised there (they time out naming this rank).
        released = _released_ranks(released_ptrs, rank, epoch, spin_limit, error_ptr, WORLD)
        if ONE_SHOT:  # every tile to every rank
            u = pid
            while u < num_tiles * split_k:
                j = u // split_k
                chunk = u % split_k
                first, end, n_tile = _tile_place(j, n_tiles, tiles_per_rank, band_rows, M, BLOCK_M, SCATTER)
                acc = _partial_tile(x_ptr, w_ptr, stride_xm, stride_xk, stride_wk, stride_wn, first, end, n_tile, N,
                                    K, chunk, k_chunk, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, DOT_FP32)
                slot = ((rank * split_k + chunk) * tiles_per_rank + j).to(tl.int64) * slot_size
                row_mask = first + rows < end
                for step in tl.static_range(1, WORLD + 1):  # remote first, rotated by rank
                    dest = (rank + step) % WORLD
                    recv = tl.load(recv_ptrs + dest).to(tl.pointer_type(tl.float32))
                    tl.store(recv + parity * recv_half + slot + rows[:, None] * BLOCK_N + cols[None, :], acc,
                             mask=row_mask[:, None] & (((released >> dest) & 1) != 0))
                u += num_programs
            for step in tl.static_range(1, WORLD + 1):
                dest = (rank + step) % WORLD
                if ((released >> dest) & 1) != 0:
                    _send_signature(signature_ptrs, ready_ptrs, dest, signature_half, rank, signature, flag_stride,
                                    epoch)
        else:  # each tile to its owner, owners remote first, rotated by rank
            for step in tl.static_range(1, WORLD + 1):
                owner = (rank + step) % WORLD
                owned = tl.minimum(tl.maximum(num_tiles - owner * tiles_per_rank, 0), tiles_per_rank)
                recv = tl.load(recv_ptrs + owner).to(tl.pointer_type(tl.float32)) + parity * recv_half
                taken = ((released >> owner) & 1) != 0
                u = tl.where(taken, pid, owned * split_k)
                while u < owned * split_k:
                    j = u // split_k
                    chunk = u % split_k
                    first, end, n_tile = _tile_place(owner * tiles_per_rank + j, n_tiles, tiles_per_rank, band_rows,
                                                     M, BLOCK_M, SCATTER)
                    acc = _partial_tile(x_ptr, w_ptr, stride_xm, stride_xk, stride_wk, stride_wn, first, end, n_tile,
                                        N, K, chunk, k_chunk, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, DOT_FP32)
                    slot = ((rank * split_k + chunk) * tiles_per_rank + j).to(tl.int64) * slot_size
                    row_mask = first + rows < end
                    tl.store(recv + slot + rows[:, None] * BLOCK_N + cols[None, :], acc, mask=row_mask[:, None])
                    u += num_programs
                if taken:
                    _send_signature(signature_ptrs, ready_ptrs, owner, signature_half, rank, signature, flag_stride,
                                    epoch)

    if PHASES & 2:  # reduce this rank's tiles (one-shot: all of them), store them into the output(s)
        first_tile = 0 if ONE_SHOT else rank * tiles_per_rank
        owned = tl.minimum(tl.maximum(num_tiles - first_tile, 0), tiles_per_rank)
        recv = tl.load(recv_ptrs + rank).to(tl.pointer_type(tl.float32)) + parity * recv_half
        ready = tl.load(ready_ptrs + rank).to(tl.pointer_type(tl.int32))
        arrived = epoch > 0  # (true) every flag this program waited for came, unless a wait gives up
        j = pid
        while j < owned:
            for source in tl.static_range(WORLD):  # the flags of the programs that produced tile j's units
                chunk = 0
                while chunk < split_k:
                    producer = (j * split_k + chunk) % num_programs
                    arrived &= wait_or_record(ready + source * flag_stride + producer, epoch, spin_limit, error_ptr,
                                              source, first_tile + j)
                    chunk += 1
            tl.debug_barrier()  # the flags this program's threads acquired cover the partials any of them loads
            if j == pid:  # the program's first tile: the peers' calls (a flag of each is seen), once per call
                same_unrefused_calls(signatures, rank, signature, error_ptr, first_tile + j, epoch, WORLD)
            first, end, n_tile = _tile_place(first_tile + j, n_tiles, tiles_per_rank, band_rows, M, BLOCK_M, SCATTER)
            out_rows = first + rows
            # After a wait gave up, no tile is stored, nor the output flag (below): a late peer's output half holds
            # its call before last, valid until it begins this one; and finding the flag, it would take the tiles
            # there as this call's (it times out instead).
            row_mask = (out_rows < end) & arrived
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for source in tl.static_range(WORLD):
                chunk = 0
                while chunk < split_k:
                    slot = ((source * split_k + chunk) * tiles_per_rank + j).to(tl.int64) * slot_size
                    acc += tl.load(recv + slot + rows[:, None] * BLOCK_N + cols[None, :], mask=row_mask[:, None],
                                   other=0.0, cache_modifier=".cg")  # peers wrote these: not from L1
                    chunk += 1
            result = acc.to(OUT_DTYPE)
            n = n_tile * BLOCK_N + cols
            out_mask = row_mask[:, None] & (n[None, :] < N)
            if SCATTER:  # this rank's band of rows is its whole output
                out_rows -= rank * band_rows
            out_offsets = out_rows[:, None].to(tl.int64) * N + n[None, :]
            if ONE_SHOT or SCATTER:  # one-shot: every rank reduces every tile itself; scatter: its rows alone
                out = tl.load(out_ptrs + rank).to(tl.pointer_type(OUT_DTYPE)) + parity * out_half
                tl.store(out + out_offsets, result, mask=out_mask)
            else:
                for step in tl.static_range(1, WORLD + 1):
                    out = tl.load(out_ptrs + (rank + step) % WORLD).to(tl.pointer_type(OUT_DTYPE)) + parity * out_half
                    tl.store(out + out_offsets, result, mask=out_mask)
            j += num_programs
        if not ONE_SHOT and not SCATTER:
            if arrived:
                signal_ready(done_ptrs, rank * flag_stride + pid, epoch, WORLD)
        # No tile: the peers' calls behind their flags (source, pid), once this program's are up; in an empty call
        # (M = 0) program 0's alone, which every peer's grid has (a flag of each peer guards the halves as well).
        if pid >= owned and (M > 0 or pid == 0):
            for k in tl.static_range(1, WORLD):
                source = (rank + k) % WORLD
                wait_or_record(ready + source * flag_stride + pid, epoch, spin_limit, error_ptr, source, -1)
            tl.debug_barrier()
            same_unrefused_calls(signatures, rank, signature, error_ptr, -1, epoch, WORLD)
        # The last program through (its tiles and signatures read, or its waits given up) tells every peer that my
        # half of this call is theirs again (their call after next stores into it: `_released_ranks`).
        release_when_last(reduced_ptr, released_ptrs, rank, epoch, WORLD)

    if PHASES & 4:  # wait until every owner's program `pid` has stored its tiles here (one-shot, scatter, an empty
        #             call: no peer does)
        if not ONE_SHOT and not SCATTER and M > 0:
            done = tl.load(done_ptrs + rank).to(tl.pointer_type(tl.int32))
            for storer in tl.static_range(WORLD):  # (not `owner`: a name of int32 above, unlike under a runtime if)
                wait_or_record(done + storer * flag_stride + pid, epoch, spin_limit, error_ptr, storer, pid)


@triton.jit(do_not_specialize=["rank", "epoch"])
def _refused_call_kernel(signature_ptr, signature_ptrs, ready_ptrs, done_ptrs, released_ptrs, error_ptr, rank, epoch,
                         flag_stride, spin_limit, WORLD: tl.constexpr, SLOTS: tl.constexpr, PHASES: tl.constexpr):
    """One program: a call this rank refused, in the phases of a call (the module docstring). Produce: its signature
    (signature_ptr: a RefusedCall's) into every peer's half of this epoch's parity, then its ready flags there, for
    every program (the peers' grid is not known here); reduce: wait until each peer's program 0 (every grid has one)
    has raised its ready flag of this epoch here, as a call that runs waits for its peers' flags (the guard of the
    halves that this rank's call after next writes), and only then raise its done flags there for every program: a
    peer late in an older call, after this rank's wait for it gave up, would take them for that call's and return
    the output tiles there as its own. Its signature goes only into peers through with their reduce of the call
    before last (`_released_ranks`, as a call's partials), and it releases its own half in the reduce (it reads
    none of it)."""
    if PHASES & 1:
        released = _released_ranks(released_ptrs, rank, epoch, spin_limit, error_ptr, WORLD)
        for k in tl.static_range(1, WORLD):
            peer = (rank + k) % WORLD
            if ((released >> peer) & 1) != 0:
                publish_refusal(signature_ptr, epoch, signature_ptrs, (epoch % 2) * WORLD * SIGNATURE_WORDS,
                                ready_ptrs, peer, rank, flag_stride, SLOTS)
    if PHASES & 2:
        ready = tl.load(ready_ptrs + rank).to(tl.pointer_type(tl.int32))
        for k in tl.static_range(1, WORLD):
            peer = (rank + k) % WORLD
            if wait_or_record(ready + peer * flag_stride, epoch, spin_limit, error_ptr, peer, -1):
                signal_every_program(done_ptrs, peer, rank, flag_stride, epoch, SLOTS)
        signal_ready(released_ptrs, rank, epoch, WORLD)


def default_split_k(m: int, k: int, num_tiles: int, num_programs: int, block_k: int) -> int:
    """K chunks per tile: only as many as keep the (tile, chunk) units within one per program, so a shape of as
    many tiles as programs or more is not split (the produce phase alone on one H200, M=1, K=4096 per rank, bf16:
    N=28672 on 264 programs 62.4 us unsplit against 67.1 in 2 chunks, N=8192 on 132 programs 21.3 against 24.0,
    K=8192 41.8 in 3 chunks against 36.5; cuBLAS 57.2 / 19.2 / 35.8; docs/benchmarks.md, 2026-11-23); chunks of
    at least 16 BLOCK_K tiles (the software pipeline drains at the end of each unit) and fp32 partials
    (split_k * M * N * 4 bytes) of at most 1/20 of the weight (K * N * 2)."""
    return max(1, min(num_programs // num_tiles, k // (16 * block_k), k // (40 * m)))


@dataclass(frozen=True)
class Tiling:
    """A plan's tiles and launch shape."""
    block_m: int  # the most rows of a tile, a power of two (fewer rows: M rounded up to one, at least 16)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int | None  # Triton's pipelining depth of the K loop; None: 5 at BLOCK_M 16, 3 above (where 5
    #                         stages leave no room for two programs per SM)
    programs_per_sm: int | None  # None: PROGRAMS_PER_SM, but one per SM for at most one tile per SM


# Up to 64 rows (decode, small prefill): one row of tiles; sweeps on 2 x H200 (docs/benchmarks.md, 2026-11-23).
FEW_ROWS = Tiling(block_m=64, block_n=64, block_k=128, num_warps=8, num_stages=None, programs_per_sm=None)
# More rows (a training step's tokens): the largest tiles, one program per SM (144 KiB of shared memory). On one
# H200, M = 4096 to 16384, the produce phase took 1.18-1.52x cuBLAS's x @ w against 2.3-3.9x for FEW_ROWS's tiles
# and 1.56-2.0x for 128 x 128 (docs/benchmarks.md, 2026-12-02, scripts/one_gpu/gemm_allreduce_rows.py).
MANY_ROWS = Tiling(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, programs_per_sm=1)


@dataclass
class Plan:
    """What every call of one key (GemmAllReduce._key) does alike: buffers, tiling and kernel arguments, computed
    once, and the output's two views (by epoch parity)."""
    key: tuple
    num_programs: int  # the grid
    recv: PeerBuffer | None  # None: an empty call's (M = 0), which stores no data
    out: PeerBuffer | None
    outputs: tuple[torch.Tensor, torch.Tensor]
    args: Arguments  # filled per call with x, w and the epoch
    options: dict  # launch options (num_warps, num_stages; maxnreg for more programs than SMs)
    one_shot: bool
    split_k: int  # K chunks per tile


class GemmAllReduce:
    """out = sum over the workspace's ranks of x @ w, fused into one launch (see the module docstring).

    Every rank must make the same calls in the same order: the same form (__call__ or reduce_scatter, which is
    always two-shot), M, K, N and dtype, on ops of one tiling (flags carry per-call epochs); a call unlike a peer's
    raises PeerCallMismatch on every rank, one whose operands a rank refuses its ValueError there and
    PeerRefusedInput on the others (the module docstring). A call of M = 0 (an empty batch) returns an empty
    output; it is a call all the same (see the module docstring). A plan tiles by FEW_ROWS up to 64 rows and by
    MANY_ROWS above; `block_m` ... `programs_per_sm`, where given, replace those tilings' fields (for tests and
    sweeps; the grid must stay co-resident, see the module docstring). The launch has `num_programs` persistent
    programs when given, else the tiling's programs per SM, and for FEW_ROWS PROGRAMS_PER_SM per SM, but one per SM
    for a shape of at most one tile per SM (the 2 x H200 sweep of call TP3, M=1, K=4096 per rank: N=8192 (128 tiles)
    took 34.4 us on one program per SM against 42.0 on two, half of them idle while their flags are still polled;
    N=28672 78.2 against 80.2 the other way round); the flags are sized for the largest grid. `algorithm`:
    "one_shot", "two_shot", or "auto" (by the bytes a rank pushes, see the module docstring).

    Host time per call is kept small (a GEMV's kernel takes tens of microseconds): what depends only on the
    call's key is computed once into a `Plan`, and GPUs launch the plan's compiled binary (kernels/launch.py).
    The output is one of the plan's two views into symmetric memory: the same tensor object every other call.
    Plans are dropped when a larger shape grows the symmetric buffers they point into.
    """

    def __init__(self, workspace: _Workspace, num_programs: int | None = None, spin_limit: int = DEFAULT_SPIN_LIMIT,
                 block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 programs_per_sm: int | None = None, algorithm: str = "auto"):
        check_spin_limit(spin_limit, "spin_limit")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: expected one of {ALGORITHMS}")
        if getattr(workspace, "transport", "p2p") != "p2p":
            raise NotImplementedError("the fused GEMM + all-reduce stores through peer pointers (transport p2p)")
        self.ws = workspace
        self.rank, self.world = workspace.rank, workspace.world_size
        device = workspace.device
        given = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm)
        self.tilings = [replace(t, **{k: v for k, v in given.items() if v is not None}) for t in (FEW_ROWS, MANY_ROWS)]
        self.given_programs = num_programs
        # the grids' programs per SM, for their register bound (`_plan`); none in a simulated world on the CPU
        per_device = num_programs is None or torch.device(device).type == "cuda"
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if per_device else None
        if num_programs is None:
            num_programs = max(t.programs_per_sm or PROGRAMS_PER_SM for t in self.tilings) * self.sm_count
        self.num_programs, self.spin_limit = num_programs, spin_limit  # the largest grid: the flags' stride
        self.split_k = split_k
        self.algorithm = algorithm
        self.errors = PeerErrors(device, self.rank, "fused GEMM + all-reduce", describe_calls=describe_calls,
                                 describe_refused=describe_refused_calls(self.rank, describe_refusal))
        self.ready = workspace.buffer("gemm_allreduce_ready", self.world * num_programs, torch.int32)
        self.done = workspace.buffer("gemm_allreduce_done", self.world * num_programs, torch.int32)
        # every source's signature of its call, in two halves by epoch parity, as the receive slots
        self.signatures = workspace.buffer("gemm_allreduce_signatures", 2 * self.world * SIGNATURE_WORDS.value,
                                           torch.int64)
        # released[r]: the last call whose reduce rank r is through with (the module docstring: buffers), and the
        # count of this rank's programs through it in the current launch (the last one raises released everywhere)
        self.released = workspace.buffer("gemm_allreduce_reduce_ack", self.world, torch.int32)
        self.reduced = torch.zeros(1, dtype=torch.int32, device=device)
        self._plans: dict[tuple, Plan] = {}
        self._launches = CompiledLaunches(_gemm_allreduce_kernel)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._call(x, w, scatter=False)

    def reduce_scatter(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This rank's band of rows of the sum over ranks of x @ w: rows [rank, rank + 1) * M / world (M a multiple
        of the world size), as reduce_scatter_tensor cuts them; on the same flags and epochs as __call__."""
        return self._call(x, w, scatter=True)

    def _call(self, x: torch.Tensor, w: torch.Tensor, scatter: bool) -> torch.Tensor:
        """One call in one launch, planned (its operands checked) before it takes its epoch; a call this rank
        refuses takes its epoch and runs all the same (see the module docstring), and raises at `output`."""
        plan = self._plan_of(x, w, ALL_PHASES, scatter)
        epoch = self.next_epoch()
        self._enqueue(plan, x, w, epoch, ALL_PHASES)
        return self.output(epoch, plan)

    def _tiling(self, m: int) -> Tiling:
        few, many = self.tilings
        return few if m <= few.block_m else many

    def _programs(self, num_tiles: int, tiling: Tiling) -> int:
        """A plan's grid (see the class docstring)."""
        if self.given_programs is not None:
            return self.given_programs
        if tiling.programs_per_sm is not None:
            return tiling.programs_per_sm * self.sm_count
        return self.sm_count if num_tiles <= self.sm_count else PROGRAMS_PER_SM * self.sm_count

    def next_epoch(self) -> int:
        self.errors.check()
        return self.ws.next_epoch("gemm_allreduce")

    @staticmethod
    def _key(x: torch.Tensor, w: torch.Tensor, phases: int, scatter: bool) -> tuple:
        """What the plan and the compiled kernel's specialisation follow from: shapes (M, N, K are specialised),
        strides (passed as ints), dtypes, the 16-byte alignment of x and w, the phases and the form (constexprs);
        and their devices (operands on another device than the workspace's are refused: `refusal`)."""
        return (x.shape, w.shape, x.stride(), w.stride(), x.dtype, w.dtype, aligned(x), aligned(w), phases, scatter,
                x.device, w.device)

    def launch(self, x: torch.Tensor, w: torch.Tensor, epoch: int, phases: int, scatter: bool = False
               ) -> Plan | RefusedCall:
        """Enqueue `phases` of call `epoch` (ALL_PHASES on GPUs; one phase at a time in a simulated world);
        scatter: the reduce-scatter form. Returns what `output` takes."""
        plan = self._plan_of(x, w, phases, scatter)
        self._enqueue(plan, x, w, epoch, phases)
        return plan

    def _enqueue(self, plan: Plan | RefusedCall, x: torch.Tensor, w: torch.Tensor, epoch: int, phases: int) -> None:
        if isinstance(plan, RefusedCall):
            _refused_call_kernel[(1,)](plan.signature, self.signatures.peer_ptrs, self.ready.peer_ptrs,
                                       self.done.peer_ptrs, self.released.peer_ptrs, self.errors.word, self.rank,
                                       epoch, self.num_programs, self.spin_limit, WORLD=self.world,
                                       SLOTS=triton.next_power_of_2(self.num_programs), PHASES=phases)
        else:
            self._launches(plan.key, (plan.num_programs, 1, 1), plan.args(x, w, epoch), plan.options)

    def prepare(self, x: torch.Tensor, w: torch.Tensor, phases: int = ALL_PHASES, scatter: bool = False) -> Plan:
        """The plan of calls like (x, w), made and (on GPUs) compiled and loaded now, launching nothing. A first
        call does this itself; calling it ahead keeps the compile out of a call whose peers are already waiting
        (loading a binary can wait for the GPU to go idle, which a launch spinning on a peer's flags never does
        when two ranks share one GPU)."""
        plan = self._plan_of(x, w, phases, scatter)
        if isinstance(plan, RefusedCall):  # no call: raised here alone
            raise plan.error
        self._launches.compiled(plan.key, (plan.num_programs, 1, 1), plan.args(x, w, 0), plan.options)
        return plan

    def _plan_of(self, x: torch.Tensor, w: torch.Tensor, phases: int, scatter: bool) -> Plan | RefusedCall:
        """The plan of calls like (x, w), or, for operands this rank refuses, the RefusedCall that stands in for it
        (not kept: a refused call plans anew)."""
        key = self._key(x, w, phases, scatter)
        return self._plans.get(key) or self._plan(key, x, w, phases, scatter)

    def _plan(self, key: tuple, x: torch.Tensor, w: torch.Tensor, phases: int, scatter: bool) -> Plan | RefusedCall:
        refused = refusal(x, w, scatter, self.world, self.ready.local.device)
        if refused is not None:
            return RefusedCall.of(*refused, self.ws.device)
        (m, k), n = x.shape, w.shape[1]
        out_rows = m // self.world if scatter else m  # the rows of this rank's output
        tiling = self._tiling(out_rows)
        block_m = max(16, triton.next_power_of_2(min(out_rows, tiling.block_m)))
        n_tiles = triton.cdiv(n, tiling.block_n)
        output_tiles = triton.cdiv(out_rows, block_m) * n_tiles  # the tiles of one output
        num_tiles = output_tiles * (self.world if scatter else 1)
        # An empty call (M = 0) raises the flags of every program a peer's grid may have (the largest grid's).
        P = self._programs(num_tiles, tiling) if m else self.num_programs
        split_k = self.split_k or (default_split_k(m, k, num_tiles, P, tiling.block_k) if m else 1)
        k_tiles = triton.cdiv(triton.cdiv(k, split_k), tiling.block_k)
        split_k = triton.cdiv(k, k_tiles * tiling.block_k)  # K chunks of whole BLOCK_K tiles, none of them empty
        one_shot = not scatter and self._one_shot(split_k * m * n * 4)
        # The tiles a rank reduces: scatter, its band's; one-shot, all; two-shot, a contiguous range.
        tiles_per_rank = output_tiles if scatter or one_shot else triton.cdiv(num_tiles, self.world)
        slot_rows = min(out_rows, block_m)
        recv_size = 2 * self.world * split_k * tiles_per_rank * slot_rows * tiling.block_n
        if max(recv_size, 2 * out_rows * n) // 2 >= 2**31:  # the halves' offsets are not in the key: keep them int32
            return RefusedCall.of(*too_large(x, w), self.ws.device)
        if m:
            recv, out, outputs = self._buffers(recv_size, out_rows, n, x.dtype)
            recv_ptrs, out_ptrs = recv.peer_ptrs, out.peer_ptrs
            recv_half, out_half = recv.local.numel() // 2, out.local.numel() // x.element_size() // 2
        else:  # no tile to store: no buffer asked for (a peer's call of rows would allocate alone), no data pointer
            #    read (the signatures' table stands in for them)
            recv = out = None
            outputs = (x.new_empty(0, n),) * 2
            recv_ptrs = out_ptrs = self.signatures.peer_ptrs
            recv_half = out_half = 0
        interpret = self._launches.interpret
        options = dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages or (5 if block_m == 16 else 3))
        per_sm = -(-P // self.sm_count) if self.sm_count else 1
        if per_sm > 1:  # the grid co-resident (the module docstring)
            options["maxnreg"] = registers_per_thread(per_sm, tiling.num_warps)
        args = Arguments(
            _gemm_allreduce_kernel, ("x_ptr", "w_ptr", "epoch"),
            stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wk=w.stride(0), stride_wn=w.stride(1),
            recv_ptrs=recv_ptrs, out_ptrs=out_ptrs, ready_ptrs=self.ready.peer_ptrs,
            done_ptrs=self.done.peer_ptrs, signature_ptrs=self.signatures.peer_ptrs,
            released_ptrs=self.released.peer_ptrs, error_ptr=self.errors.word, reduced_ptr=self.reduced,
            rank=self.rank, M=m, N=n, K=k, dtype_code=dtype_code(x.dtype),
            recv_half=recv_half, out_half=out_half, num_tiles=num_tiles, n_tiles=n_tiles,
            tiles_per_rank=tiles_per_rank, band_rows=out_rows, slot_rows=slot_rows, split_k=split_k,
            k_chunk=k_tiles * tiling.block_k, num_programs=P, flag_stride=self.num_programs, spin_limit=self.spin_limit,
            WORLD=self.world, BLOCK_M=block_m, BLOCK_N=tiling.block_n,
            BLOCK_K=tiling.block_k, K_TILES=k_tiles, OUT_DTYPE=TL_DTYPES[x.dtype], DOT_FP32=interpret, PHASES=phases,
            ONE_SHOT=one_shot, SCATTER=scatter)
        plan = self._plans[key] = Plan(key, P, recv, out, outputs, args, options, one_shot, split_k)
        return plan

    def _buffers(self, recv_size: int, out_rows: int, n: int, dtype: torch.dtype
                 ) -> tuple[PeerBuffer, PeerBuffer, tuple[torch.Tensor, torch.Tensor]]:
        """The receive slots (fp32, `recv_size` elements), the outputs' buffer and the two [out_rows, n] output
        views of a call's plan (grown where the call needs more)."""
        recv = self.ws.buffer("gemm_allreduce_recv", recv_size, torch.float32)
        # In bytes: a call of the other dtype (fp16 and bf16 are alike in size) keeps the buffer; typed, it was
        # allocated anew at every change of dtype, a collective that on GPUs synchronises the device (and that a
        # rank whose call's dtype differs from its peers' would enter alone).
        out = self.ws.buffer("gemm_allreduce_out", 2 * out_rows * n * dtype.itemsize, torch.uint8)
        # Plans made before a buffer grew point into the old one: drop them (their keys plan anew).
        self._plans = {k: p for k, p in self._plans.items() if p.recv is recv and p.out is out}
        local = out.local.view(dtype)
        half = local.numel() // 2
        size = out_rows * n
        return recv, out, (local[:size].view(out_rows, n), local[half:half + size].view(out_rows, n))

    def _one_shot(self, partial_bytes: int) -> bool:
        """Whether a call whose fp32 partials take `partial_bytes` runs one-shot (see the module docstring)."""
        if self.algorithm != "auto":
            return self.algorithm == "one_shot"
        return (self.world - 1) * partial_bytes <= ONE_SHOT_MAX_BYTES

    def output(self, epoch: int, plan: Plan | RefusedCall) -> torch.Tensor:
        """The [M, N] result of call `epoch` (reduce-scatter: [M / world, N]) once its WAIT phase ran, launched with
        `plan`; valid until the call after next. A call this rank refused raises its error here."""
        if isinstance(plan, RefusedCall):
            raise plan.error
        self.errors.after_wait()
        return plan.outputs[epoch % 2]
