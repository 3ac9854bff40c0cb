"""AllGather + GEMM (column-parallel linear): out = all_gather(x_shard) @ weight, the GEMM consuming chunks as
they arrive.

    all_gather_matmul(x_shard [rows, K], weight [K, N], workspace, producer="device" | "copy_engine", *,
                      return_gathered=False, out=None, config=None) -> out [world * rows, N]
                      (or (out, gathered [world * rows, K]) with return_gathered=True)

The consumer is one persistent Triton GEMM (fp16/bf16 in, fp32 accumulate) reading both operands through TMA
(kernels/tma.py: K must be a multiple of 8, and the weight's contiguous dim too). Its M-tiles never straddle two
source ranks. Sources are taken in the order rank, rank - 1, rank - 2, ...: the local shard first (read in place
from x_shard, no wait), then the peers. Before its first tile of source s, a program waits (bounded) for the flag
of every chunk of s that its tiles of s read (`_tile_chunks`: one chunk per tile when chunk_rows is a multiple of
block_m, two when a tile straddles a chunk boundary), then fences the async proxy (TMA reads what the flags
cover) and runs those tiles in one loop flattened into the K loop, so each tile's first loads overlap the previous
tile's epilogue; a peer's chunks all travel at once, so waiting for them per source rather than per tile costs
little, and per tile would break the flattened loop (its loads run stages ahead, into the next tile). Against
pointer loads and a loop per tile: 504 against 520 us at issue 5's shape on one H200, cuBLAS 499
(docs/benchmarks.md, 2026-11-25). The shards travel through `SymmetricAllGather`'s buffers and flags:
- producer="copy_engine": every rank publishes its shard into its own slot (a local copy, then its own flags);
  the consumer waits once (current stream) for every peer's published shard, then pulls it chunk by chunk with the
  copy engines on one side stream per peer, each chunk followed by a stream-written flag in its *own* memory
  (`SymmetricAllGather.pull_published`; torch's fused_all_gather_matmul does the same). The GEMM polls only flags
  that its own GPU wrote after its own copies into its own memory.
- producer="device": the GEMM's own programs first push their share of chunks to the peers, then compute; the
  pushers (the last programs, one per chunk at most) leave the first rounds of local tiles to the others (as many
  as the push takes tiles' time, `lead_rounds`), so that they do not finish a push's time after the rest. One
  launch, not a push kernel on another stream: two kernels whose programs wait on each other deadlock when the
  consumer's persistent programs take every SM before the producer's are scheduled; inside one launch whose grid
  is at most one program per SM, every program is resident. So a rank whose GemmConfig.num_programs exceeds its
  GPU's SM count refuses its device calls (`grid_problem`; its copy-engine calls keep the grid: their GEMM waits
  only for flags its own streams write). (The interpreter runs a launch's programs one after another, so in a
  simulated world, on the CPU or on one GPU, the same kernel runs twice: push only for every rank, then compute;
  any grid.)
The last program to finish acknowledges the epoch to every peer (a never-reset launch counter of this op reaching
launches * programs): the guard that lets peers overwrite the other half of the double buffer next time.
With return_gathered=True the gathered input (the column-parallel backward needs it) is copied out of the
buffer half after the launch, the local shard into its slot. The tiles must not store the A blocks they load:
a second use of the pipelined operand makes Triton 3.6 (sm_90, 3 stages) keep only 2 shared-memory buffers for A
while one wgmma stays in flight and the loads run 2 iterations ahead, so the load of iteration i + 2 overwrote
the A block that iteration i's wgmma was still reading (wrong products on H200, relative error 0.06-0.14, while
the gathered rows were exact; visible in the compiled TTGIR: `memdesc<2x128x64xf16>` for A against 3 buffers
without the store).

Calls that differ between ranks (rows, K, dtype, producer, rows per chunk: a caller's bug) use exchanges of other
shape classes, whose buffers and flags the peers' calls never touch (ranks whose first calls differ ask for other
buffers, refused before the allocation; calls of shape classes every rank has allocated would not be). So the ranks
compare their calls in a buffer of the workspace's own (CALLS: two halves by the call's parity, shared by every
shape class and producer; then the refused calls' descriptions, below): each call has a number among the workspace's
calls of the op and a signature (`_call_signature`: that number, the shard's shape and dtype, the producer and its
rows per chunk, and the exchange's epoch), published into every peer as a flag of its own (word 0, the number,
stored last with release: `peer_flags.publish_signature`) by the device push's last program before its chunks, or
for the copy engines by a small kernel after the shard is published; each GEMM program reads a peer's once per call
before waiting for its chunks (`peer_flags.same_published_call`: bounded, a peer that never calls times out naming
the rank), the copy engines' pulls after a small kernel that does the same. One unlike its own records error 3
(`PeerErrors` names rank, peer and both calls in words), after which the call's waits look once and its output is
not defined: every rank raises. The calls' numbers stay alike, but the exchanges' epochs of the ranks do not: the
next calls of those shapes differ in the signature's last word and raise too (or time out waiting for a buffer a
peer never released), never read another call's half. The guard of the signatures' halves is the check itself: a
rank publishes call c + 2 only after its call c + 1 has seen every peer's signature of call c + 1, published once
the peer's call c (its reads of half c % 2) was over. What a rank's GEMM alone reads (N, the weight, the tiles and
grid) is not compared: ranks may differ in it. A call that makes only some ranks allocate (a shape class or producer
new to them) stops before its kernels: the ranks' requests are compared before each collective allocation
(dist/symmetric.agree_on_allocation), so those ranks raise AllocationTimeout naming the peers that never asked, and
a peer whose next allocation is another buffer raises AllocationMismatch.
A call whose weight or out one rank refuses, or whose x_shard, weight or out lies on another device than the
workspace's (`refused_call`: what each rank's own tensors decide, N may differ; x_shard of the peers' shape class;
`peer_flags.foreign_operand`: a kernel would read another GPU's memory), or a device push on a grid its GPU does
not hold at once (each rank's own config) is still a call there
(peer_flags.RefusedCall): raising alone would leave its peers waiting out their bound, and its call numbers and
exchange epochs one behind theirs for every later call. It takes its number and its exchange's epoch, publishes a
signature that says why ([number, REFUSED_CALL, refusal words]), after what its call would have published (its
exchange and epoch, `_call_signature`) into a second part of CALLS (the descriptions, released by that signature's
flag), and acknowledges the epoch (it reads nothing of it), then waits for every peer's published call, as the GEMM
does (`_refused_call_kernel`). A
peer's program that reads that signature records the refusal (code 5, `same_published_call`), after which its
waits look once: every other rank raises PeerRefusedInput naming the rank and why, the refusing rank its own
ValueError at `finish`, and the next call is exact. A refused x_shard of no shape class (`shard_problem`: not
[rows, K], a dtype other than fp16 / bf16, K not a multiple of 8) or an unknown producer names no exchange, so the
rank cannot take the epoch of the one its peers use as the call begins (each shape class and producer counts its
own, which its double buffers' guard needs consecutive). Its call is one of no exchange (`refuse_call`, through any
op of the workspace: they share CALLS): it takes its number, publishes its refusal and waits for every peer's call,
so every rank raises as above. Raising alone left the calls' numbers apart too: the rank's next call then matched its
peers' refused one, whose chunks it found behind flags of the epoch it took, and so paired shards of two calls
without an error. Then it catches up (`_catch_up`): the peers' signatures of the call, read on the host behind that
wait (a sync, in a call that raises anyway; they stay until this rank's next call lets the peers publish the call
after next), name the exchange and epoch they used (a refused peer's, its description; a peer's call of no exchange
names none). Where those that name one name the same, one epoch ahead of this rank's, the rank takes that epoch and
acknowledges it (the refused call's ack: it reads nothing of it; empty shards have no exchange: the epoch alone), so
the exchange's next call is exact, refused on every rank or not. Otherwise (peers' calls unlike each other, every
one of no exchange, a signature that never came) the exchange's epochs stay apart: its next calls raise on every
rank (as after calls that differ), and a call of a shape class new to every rank is exact. The catch-up allocates
nothing: a rank that holds no such exchange leaves it (on GPUs its peers' call could not have allocated one without
it: their allocation times out naming it, as above). A rank with no op yet (its first call) has no CALLS to refuse
it through, but its peers' first call allocates CALLS first: it refuses in that allocation's place
(`_Workspace.refuse_allocation`), so every peer raises AllocationRefused naming it and why, no buffer is made, and
the next call is exact.
`all_gather_matmul_bulk` is the bulk twin (all_gather_into_tensor + matmul);
`all_gather_matmul_reference` the pure-torch definition.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fused_dlrm.config_checks import check_count
from fused_dlrm.dist.symmetric import AllocationRefused, AllocationRequest, _Workspace
from fused_dlrm.kernels import DTYPES, dtype_code, dtype_name
from fused_dlrm.kernels.allgather import SymmetricAllGather, push_chunk, wait_chunk
from fused_dlrm.kernels.launch import interpreting
from fused_dlrm.kernels.peer_flags import (DEFAULT_SPIN_LIMIT, REFUSED_CALL, SIGNATURE_WORDS, TENSOR_WORDS, PeerErrors,
                                           RefusedCall, check_spin_limit, describe_foreign, describe_refused_calls,
                                           describe_signatures, describe_tensor, foreign_operand, publish_signature,
                                           same_published_call, signal_ready, signature_of, store_signature,
                                           tensor_words, wait_published)
from fused_dlrm.kernels.tma import async_proxy_fence, descriptor, tma_problem, tma_readable

GEMM_PRODUCERS = ("copy_engine", "device")
PRODUCER_WORDS = ("copy-engine pulls", "device push")  # GEMM_PRODUCERS in a call's description
CALLS = "allgather_matmul_calls"  # a workspace's count of the op's calls and the buffer of their signatures


def calls_numel(world: int) -> int:
    """The CALLS buffer's int64 words: every peer's signature, in two halves by the call's parity, then as many for
    what the peers' refused calls of an exchange describe (`_described_half`)."""
    return 2 * 2 * world * SIGNATURE_WORDS.value


def all_gather_matmul_reference(shards: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    return torch.cat(shards).double() @ weight.double()


def all_gather_matmul_bulk(x_shard: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bulk twin: (all_gather(x_shard) @ weight, the gathered input)."""
    world = dist.get_world_size(group)
    gathered = x_shard.new_empty((world * x_shard.shape[0], x_shard.shape[1]))
    dist.all_gather_into_tensor(gathered, x_shard.contiguous(), group=group)
    return gathered @ weight, gathered


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 256  # 128 x 256 tiles beat 128 x 128 at every benchmarked shape on H200 (2026-11-22)
    block_k: int = 64
    group_m: int = 16  # M-blocks walked together per N sweep (L2 reuse of the weight)
    chunk_rows: int = 256  # device push: rows per flag (best a multiple of block_m; a tile straddling two chunks
    # waits for both): small enough to start remote tiles early; one pushing program per chunk
    copy_rows: int | None = None  # copy-engine producer: rows per copy and flag (None: the whole shard, one
    # cudaMemcpyAsync + one stream-written flag per peer, as torch's fused_all_gather_matmul). Each chunk costs the
    # host a copy_ and a stream_write_value32_; at 256 rows (16 chunks, publish + pull) that was 64 ops per call
    num_warps: int = 8
    # 4 stages and groups of 16 M-blocks: the GEMM alone (flags already up) at M=8192, N=11008/2, K=4096 fp16 on one
    # H200 took 555.6 us against 661.1 at 3 stages and groups of 8 (cuBLAS 538.5; 2026-11-23, docs/benchmarks.md)
    num_stages: int = 4
    num_programs: int | None = None  # persistent programs; None: one per SM (all co-resident). The device push
    # refuses more than the SMs (its programs wait for each other's, `grid_problem`); the copy engines take any
    spin_limit: int = DEFAULT_SPIN_LIMIT
    push_rounds: int | None = None  # device push: rounds of local tiles that the pushing programs leave to the
    # others (None: the push's estimated time in tiles' time, `lead_rounds`)

    def __post_init__(self):  # at construction, alike on every rank that builds it, not at a launch on one rank
        check_spin_limit(self.spin_limit, "GemmConfig.spin_limit")
        # tl.arange's and tl.dot's sizes, and Triton's warps: powers of two
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            check_count(f"GemmConfig.{name}", value, 1, "a power of two")
            if value & (value - 1):
                raise ValueError(f"GemmConfig.{name}={value!r}: expected a power of two")
        for name, minimum in (("group_m", 1), ("chunk_rows", 1), ("num_stages", 1)):
            check_count(f"GemmConfig.{name}", getattr(self, name), minimum, f"a whole number >= {minimum}")
        for name, minimum in (("copy_rows", 1), ("num_programs", 1), ("push_rounds", 0)):
            if getattr(self, name) is not None:
                check_count(f"GemmConfig.{name}", getattr(self, name), minimum, f"a whole number >= {minimum} or None")


# For `lead_rounds`' estimate: the rate at which the pushing programs (one per chunk: 16 at issue 5's shape) move a
# peer's rows, and one SM's fp16/bf16 tensor rate in this GEMM (653-731 TFLOP/s over 132 SMs on H100/H200). The
# push rate is fitted, not the link's 385 GB/s: on 2×H200 (2026-11-26, docs/benchmarks.md) the best rounds were
# 3 at M=8192 (661 us; 2: 673, 4-6: 669-674), 2-5 at M=4096 (336-338; 6: 345) and 3-6 at M=16384 (1,869-1,882;
# 2: 1,930), which ~200 GB/s gives (2, 3 and 6) and 375 GB/s does not (1, 2 and 3).
PUSH_BYTES_PER_S = 200e9
SM_FLOPS_PER_S = 5.2e12


def lead_rounds(world: int, rows: int, k: int, element_size: int, config: GemmConfig) -> int:
    """Rounds of local tiles the pushing programs skip: pushing every peer's rows takes them about as long as that
    many tiles take the others."""
    if config.push_rounds is not None:
        return config.push_rounds
    push_s = (world - 1) * rows * k * element_size / PUSH_BYTES_PER_S
    tile_s = 2 * config.block_m * config.block_n * k / SM_FLOPS_PER_S
    return round(push_s / tile_s)


@triton.jit
def _call_signature(call, rows, K, dtype_code, producer, chunk_rows, epoch):
    """What a peer's call must share with this one (`describe_calls` reads it): its number among the workspace's
    calls of the op (its epoch: word 0), the shard's shape and dtype, how it travels (the producer: GEMM_PRODUCERS'
    index; rows per chunk and flag), and its exchange's epoch (a call that differed left the exchanges' epochs of
    its ranks apart: the later calls of those shapes differ too, rather than read halves and flags of other calls).
    Not N, the weight or the tiles: each rank's GEMM is its own."""
    return signature_of((call, rows, K, dtype_code, producer, chunk_rows, epoch))


def describe_calls(mine: list[int], theirs: list[int]) -> tuple[str, str]:
    """Two calls' signatures (`_call_signature`) in words: "x_shard [41, 24] float16, device push in chunks of 16
    rows" (of an empty shard: "..., device push of nothing"), then the exchange's epoch and the step where they
    differ."""
    def call(signature: list[int]) -> str:
        _, rows, k, dtype, producer, chunk_rows = signature[:6]
        chunks = f"in chunks of {chunk_rows} rows" if rows else "of nothing"
        return f"x_shard [{rows}, {k}] {dtype_name(dtype)}, {PRODUCER_WORDS[producer]} {chunks}"

    return describe_signatures(mine, theirs, call, {6: "call {} of that shape and producer"})


@triton.jit
def _calls_half(call, WORLD: tl.constexpr):
    """The offset of call `call`'s half of the signature buffers (by its parity: the call after next reuses it)."""
    return (call % 2) * WORLD * SIGNATURE_WORDS


@triton.jit
def _described_half(call, WORLD: tl.constexpr):
    """The offset of call `call`'s half of the descriptions: what a refused call of an exchange would have published
    as its signature (`_call_signature`: its exchange and epoch, for a peer's `_catch_up`), after the signatures."""
    return 2 * WORLD * SIGNATURE_WORDS + _calls_half(call, WORLD)


@triton.jit
def _publish_call(call_ptrs, call, rank, signature, WORLD: tl.constexpr):
    """This rank's signature of call `call`, published into every peer (`publish_signature`)."""
    for k in tl.static_range(1, WORLD):
        publish_signature(call_ptrs, (rank + k) % WORLD, _calls_half(call, WORLD), rank, signature, call)


@triton.jit
def _same_call_as(calls_ptr, source, call, signature, spin_limit, error_ptr, WORLD: tl.constexpr):
    """Whether `source` made call `call` as this rank did: its published signature (in this rank's buffer,
    calls_ptr), waited for (bounded) and compared."""
    return same_published_call(calls_ptr + _calls_half(call, WORLD), source, signature, call, spin_limit, error_ptr)


@triton.jit(do_not_specialize=["rank", "call", "epoch"])
def _publish_call_kernel(call_ptrs, rank, call, rows, K, dtype_code, producer, chunk_rows, epoch,
                         WORLD: tl.constexpr):
    """The copy-engine producer's `_publish_call` (the device push publishes in its own launch)."""
    _publish_call(call_ptrs, call, rank, _call_signature(call, rows, K, dtype_code, producer, chunk_rows, epoch),
                  WORLD)


@triton.jit(do_not_specialize=["rank", "call", "epoch"])
def _check_calls_kernel(calls_ptr, rank, call, rows, K, dtype_code, producer, chunk_rows, epoch, spin_limit,
                        error_ptr, WORLD: tl.constexpr):
    """Every peer's call against this rank's (`_same_call_as`), before the copy-engine pulls wait for the peers'
    published shards: a peer whose call differs publishes into another exchange's flags (those of its shape), so
    those waits would time out first."""
    signature = _call_signature(call, rows, K, dtype_code, producer, chunk_rows, epoch)
    for step in tl.static_range(1, WORLD):  # in the GEMM's order of sources: rank - 1, rank - 2, ...
        _same_call_as(calls_ptr, (rank + WORLD - step) % WORLD, call, signature, spin_limit, error_ptr, WORLD)


@triton.jit(do_not_specialize=["rank", "call", "epoch"])
def _refused_call_kernel(signature_ptr, call_ptrs, calls_ptr, ack_ptrs, rank, call, epoch, rows, K, dtype_code,
                         producer, chunk_rows, spin_limit, error_ptr, WORLD: tl.constexpr, PUBLISH: tl.constexpr,
                         DESCRIBE: tl.constexpr, ACK: tl.constexpr, WAIT: tl.constexpr):
    """One program: a call this rank refused (the module docstring). PUBLISH: its signature (signature_ptr: a
    RefusedCall's) into every peer as call `call`'s, after DESCRIBE: its exchange and epoch (rows ... epoch: as a
    call's signature, `_call_signature`) into every peer's descriptions (`_described_half`), which that signature's
    flag releases; ACK: the exchange's epoch acknowledged to every rank, as the GEMM's last program does (this call
    reads nothing of it; a call of no exchange acknowledges the one its peers used alone, `_catch_up`); WAIT: until
    every peer has published its call (the guard of the signatures' halves, as a GEMM's programs wait for them)."""
    if DESCRIBE:
        described = _call_signature(call, rows, K, dtype_code, producer, chunk_rows, epoch)
        for k in tl.static_range(1, WORLD):
            store_signature(call_ptrs, (rank + k) % WORLD, _described_half(call, WORLD), rank, described)
    if PUBLISH:
        _publish_call(call_ptrs, call, rank, tl.load(signature_ptr + tl.arange(0, SIGNATURE_WORDS)), WORLD)
    if ACK:
        signal_ready(ack_ptrs, rank, epoch, WORLD)
    if WAIT:
        for step in tl.static_range(1, WORLD):
            wait_published(calls_ptr + _calls_half(call, WORLD), (rank + WORLD - step) % WORLD, call, spin_limit,
                           error_ptr)


@triton.jit
def _tile(t, rank, rows, N, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_M: tl.constexpr):
    """Tile t of the walk: (source rank, M-block within the source, N-block). Local source first, then rank - 1, ...;
    within a source, GROUP_M M-blocks per N sweep."""
    m_blocks = tl.cdiv(rows, BLOCK_M)
    n_blocks = tl.cdiv(N, BLOCK_N)
    per_source = m_blocks * n_blocks
    source = (rank + WORLD - t // per_source) % WORLD
    u = t % per_source
    group_first = (u // (GROUP_M * n_blocks)) * GROUP_M
    group_size = tl.minimum(m_blocks - group_first, GROUP_M)
    mb = group_first + (u % (GROUP_M * n_blocks)) % group_size
    nb = (u % (GROUP_M * n_blocks)) // group_size
    return source, mb, nb


@triton.jit
def _tile_chunks(mb, rows, chunk_rows, BLOCK_M: tl.constexpr):
    """First and last chunk holding rows of M-block mb (the rows a tile reads: mb * BLOCK_M ... , below rows)."""
    first_row = mb * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, rows) - 1
    return first_row // chunk_rows, last_row // chunk_rows


@triton.jit
def _tile_product(a_desc, a_index, w_desc, out_ptr, out_row0, t, rank, rows, N, WORLD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                  GROUP_M: tl.constexpr, W_NK: tl.constexpr, DOT_FP32: tl.constexpr):
    """Tile t's product, stored at rows out_row0 + its rows of out: A blocks from slice a_index of a_desc
    ([1, BLOCK_M, BLOCK_K]; zeros past the source's rows), weight blocks from w_desc."""
    _, mb, nb = _tile(t, rank, rows, N, WORLD, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(K_TILES):
        a = a_desc.load([a_index, mb * BLOCK_M, kt * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
        if W_NK:  # a Linear's weight.t(): blocks lie [BLOCK_N, BLOCK_K], transposed in shared memory
            w = tl.trans(w_desc.load([nb * BLOCK_N, kt * BLOCK_K]))
        else:
            w = w_desc.load([kt * BLOCK_K, nb * BLOCK_N])
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(a, w, acc)
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    out = out_ptr + (out_row0 + rm)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < rows)[:, None] & (rn < N)[None, :])


@triton.jit
def _source_tiles(a_desc, a_index, w_desc, out_ptr, out_row0, t_first, t_end, num_programs, rank, rows, N,
                  WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  K_TILES: tl.constexpr, GROUP_M: tl.constexpr, W_NK: tl.constexpr, ON_GPU: tl.constexpr):
    """This program's tiles t_first, t_first + num_programs, ... below t_end, all of one source. On GPUs the tile
    loop is flattened into the K loop, so a tile's first loads are issued while the previous one's epilogue runs
    (a plain persistent GEMM at issue 5's shape on one H200: 494 against 500 us through TMA, 508 against 583 through
    pointers; docs/benchmarks.md 2026-11-25); the interpreter cannot take a runtime bound in a for loop, so it
    walks the same tiles in a while loop."""
    if ON_GPU:
        for t in tl.range(t_first, t_end, num_programs, flatten=True):
            _tile_product(a_desc, a_index, w_desc, out_ptr, out_row0, t, rank, rows, N, WORLD, BLOCK_M, BLOCK_N,
                          BLOCK_K, K_TILES, GROUP_M, W_NK, False)
    else:
        t = t_first
        while t < t_end:
            _tile_product(a_desc, a_index, w_desc, out_ptr, out_row0, t, rank, rows, N, WORLD, BLOCK_M, BLOCK_N,
                          BLOCK_K, K_TILES, GROUP_M, W_NK, True)
            t += num_programs


@triton.jit(do_not_specialize=["epoch", "ack_target", "call"])  # one compiled variant for every epoch
def _all_gather_matmul_kernel(
    x_ptr, x_desc, gathered_desc, w_desc, out_ptr, data_ptrs, ready_ptr, ready_ptrs, ack_ptr, ack_ptrs,
    counter_ptr, error_ptr, calls_ptr, call_ptrs, rows, K, N, rank, epoch, call, dtype_code, producer, chunk_rows,
    chunks, half_offset, num_programs, lead_programs, lead_tiles, spin_limit, ack_target,
    WORLD: tl.constexpr, PUSH: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    GROUP_M: tl.constexpr, PUSH_R: tl.constexpr, PUSH_C: tl.constexpr, W_NK: tl.constexpr, ON_GPU: tl.constexpr,
):
    pid = tl.program_id(0)
    signature = _call_signature(call, rows, K, dtype_code, producer, chunk_rows, epoch)  # compared with peers'
    if PUSH:  # my share of (peer, chunk) pushes, nearest peer first; no local slot: tiles read x_shard in place
        if pid == num_programs - 1:  # the call's signature first, a flag of its own (the module docstring)
            _publish_call(call_ptrs, call, rank, signature, WORLD)
        i = num_programs - 1 - pid  # the last programs push: they get one tile fewer when tiles do not divide evenly
        while i < (WORLD - 1) * chunks:
            push_chunk(x_ptr, data_ptrs, ready_ptrs, ack_ptr, error_ptr, (rank + 1 + i // chunks) % WORLD,
                       i % chunks, rank, epoch, rows, K, chunk_rows, chunks, half_offset, spin_limit, PUSH_R, PUSH_C)
            i += num_programs
    if COMPUTE:
        # The local tiles: the first lead_tiles dealt among the programs that do not push (the pushers are the
        # last programs), the rest and then the peers' tiles dealt among all, round-robin from lead_tiles on.
        per_source = tl.cdiv(rows, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        row0 = tl.cast(rank, tl.int64) * rows
        if pid < lead_programs:
            _source_tiles(x_desc, 0, w_desc, out_ptr, row0, pid, lead_tiles, lead_programs, rank, rows, N, WORLD,
                          BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, W_NK, ON_GPU)
        _source_tiles(x_desc, 0, w_desc, out_ptr, row0, lead_tiles + pid, per_source, num_programs, rank, rows, N,
                      WORLD, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, W_NK, ON_GPU)
        for step in range(1, WORLD):  # then the peers, rank - 1, rank - 2, ...
            source = (rank + WORLD - step) % WORLD
            # its call against mine, once per call, before its chunks (a call of another shape would wait for
            # flags of another exchange); a failed call's waits below look once (the error word is set)
            _same_call_as(calls_ptr, source, call, signature, spin_limit, error_ptr, WORLD)
            lo = step * per_source
            t_first = lo + (pid + num_programs - (lo - lead_tiles) % num_programs) % num_programs  # my first
            t = t_first
            while t < lo + per_source:  # every chunk that my tiles of this source read, before any of them runs
                _, mb, _ = _tile(t, rank, rows, N, WORLD, BLOCK_M, BLOCK_N, GROUP_M)
                first, last = _tile_chunks(mb, rows, chunk_rows, BLOCK_M)
                c = first
                while c <= last:
                    wait_chunk(ready_ptr, source, c, chunks, epoch, spin_limit, error_ptr)
                    c += 1
                t += num_programs
            tl.debug_barrier()  # the flags every thread saw ...
            async_proxy_fence(ON_GPU)  # ... order the rows they cover before the TMA reads below
            _source_tiles(gathered_desc, source, w_desc, out_ptr, source.to(tl.int64) * rows, t_first,
                          lo + per_source, num_programs, rank, rows, N, WORLD, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES,
                          GROUP_M, W_NK, ON_GPU)
        # The last program done acknowledges the epoch to every rank: all reads of the buffer half are over.
        # ack_target = (this op's compute launches so far) * programs: not epoch * programs, which another op on
        # the same exchange (same shape class, another tile config) would have moved on.
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
        if done == ack_target:
            signal_ready(ack_ptrs, rank, epoch, WORLD)


@triton.jit
def _tile_map_kernel(out_ptr, rank, rows, N, chunk_rows, tiles, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """For tests: row t of out = (source, mb, nb, first chunk, last chunk) of tile t, from the GEMM's own helpers."""
    t = tl.program_id(0)
    source, mb, nb = _tile(t, rank, rows, N, WORLD, BLOCK_M, BLOCK_N, GROUP_M)
    first, last = _tile_chunks(mb, rows, chunk_rows, BLOCK_M)
    tl.store(out_ptr + t * 5 + 0, source)
    tl.store(out_ptr + t * 5 + 1, mb)
    tl.store(out_ptr + t * 5 + 2, nb)
    tl.store(out_ptr + t * 5 + 3, first)
    tl.store(out_ptr + t * 5 + 4, last)


def tile_map(rank: int, world: int, rows: int, n: int, chunk_rows: int, config: "GemmConfig") -> torch.Tensor:
    """[tiles, 5] int32: (source, mb, nb, first chunk waited for, last chunk waited for) of every tile the GEMM walks
    (runs the kernel's own helpers; CPU under the interpreter)."""
    tiles = world * triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n)
    out = torch.full((tiles, 5), -1, dtype=torch.int32)
    _tile_map_kernel[(tiles,)](out, rank, rows, n, chunk_rows, tiles, WORLD=world, BLOCK_M=config.block_m,
                               BLOCK_N=config.block_n, GROUP_M=config.group_m)
    return out


class AllGatherMatmul:
    """The fused op for one shape class (rows per rank, K, dtype) on one workspace; see the module docstring. Every
    rank must make the same calls in the same order (a call unlike a peer's raises PeerCallMismatch on every rank)."""

    def __init__(self, workspace: _Workspace, rows: int, k: int, dtype: torch.dtype, config: GemmConfig):
        problem = shard_problem((rows, k), dtype)
        if problem is not None:
            raise ValueError(problem)
        self.config = config
        self.ws, self.rank, self.world = workspace, workspace.rank, workspace.world_size
        self.errors = PeerErrors(workspace.device, self.rank, "fused all-gather + GEMM", describe_calls=describe_calls,
                                 describe_refused=describe_refused_calls(self.rank, describe_refusal))
        # every peer's signature of its latest calls (two halves by the call's parity), shared by the workspace's
        # ops of every shape class: calls of other shapes use other exchanges (the module docstring). Allocated
        # first: on GPUs allocations pair by order, and an op of empty shards allocates nothing else.
        self.calls = workspace.buffer(CALLS, calls_numel(self.world), torch.int64)
        # the device push's exchange; none for shards of 0 rows (an empty batch: its calls exchange signatures alone)
        self.gather = SymmetricAllGather(workspace, rows, k, dtype, max(1, config.chunk_rows), name="allgather_matmul",
                                         spin_limit=config.spin_limit, errors=self.errors,
                                         refusals=False) if rows else None
        self.call = 0  # the number of this op's latest call among the workspace's (`start`)
        self.refused: RefusedCall | None = None  # the latest call's, if this rank refused it (`start`)
        self.rows, self.k, self.dtype = rows, k, dtype
        self.fused_push = not workspace.simulated  # a simulated world pushes in a launch of its own (module docstring)
        # The most programs of a launch that pushes and computes (`grid_problem`; None: no such launch). The SM
        # count, not the binary's residency: that binary is found only at the launch (kernel[grid]; it follows the
        # weight's layout and N), later than the call's refusal is decided; GemmConfig's own tiles compile for sm_90
        # to one program per SM anyway (190 registers x 256 threads, 224 KiB of shared memory).
        self.resident_programs = (torch.cuda.get_device_properties(workspace.device).multi_processor_count
                                  if self.fused_push else None)
        self.num_programs = config.num_programs or (self.gather.num_programs if rows else 1)
        self._copy_gather: SymmetricAllGather | None = None  # the copy-engine producer's, built on first use
        self.counter = torch.zeros(1, dtype=torch.int64, device=workspace.device)  # programs done, never reset
        self.launches = 0  # compute launches of this op: the counter reaches launches * programs at each ack

    def gather_for(self, producer: str) -> SymmetricAllGather:
        """The device push's exchange (chunks of chunk_rows), or the copy engines' (chunks of copy_rows: few large
        copies; its own buffers, allocated on the first copy-engine call; the op's one error word). That first
        call allocates symmetric memory, a collective: every rank must make it (ranks that make it alone raise
        AllocationTimeout after the allocation's bounded wait for their peers' requests)."""
        if producer != "copy_engine" or not self.rows:
            return self.gather
        if self._copy_gather is None:
            g = self.gather
            self._copy_gather = SymmetricAllGather(g.ws, self.rows, self.k, g.dtype, self.config.copy_rows or self.rows,
                                                   name="allgather_matmul_ce", spin_limit=self.config.spin_limit,
                                                   errors=self.errors, refusals=False)
        return self._copy_gather

    def start(self, x_shard: torch.Tensor, producer: str, refused: RefusedCall | None = None) -> int:
        """Enqueue the producer side; returns the epoch (on GPUs the device push runs inside `finish`'s launch),
        which `finish` takes: every start is finished before the op's next one. refused: this rank refuses the
        call (`refused_call`): a call all the same, whose signature says why, and whose `finish` raises."""
        if producer not in GEMM_PRODUCERS:
            self.refuse_call(RefusedCall.of([UNKNOWN_PRODUCER], ValueError(
                f"unknown producer {producer!r}: expected one of {GEMM_PRODUCERS}"), self.ws.device))
        self.errors.check()
        self.call, self.refused = self.ws.next_epoch(CALLS), refused
        g = self.gather_for(producer)
        if refused is not None:  # the exchange's epoch taken, nothing published but why, the exchange acknowledged
            epoch = g.next_epoch() if g else self._empty_epoch()
            self._refused_call(refused.signature, self.call, epoch, g, publish=True, ack=g is not None,
                               described=self._described(producer))
            return epoch
        if not self.rows:  # nothing to exchange: the call's signature alone (`finish` compares the peers'), its
            #                epoch the count of the op's calls
            epoch = self._empty_epoch()
            _publish_call_kernel[(1,)](self.calls.peer_ptrs, self.rank, self.call, *self._described(producer), epoch,
                                       WORLD=self.world)
            return epoch
        if producer == "copy_engine":  # publish into our own slot; peers pull it (see the module docstring)
            epoch = g.start(x_shard, "pull")
            _publish_call_kernel[(1,)](self.calls.peer_ptrs, self.rank, self.call, *self._described(producer), epoch,
                                       WORLD=self.world)
            return epoch
        epoch = self.gather.next_epoch()
        if not self.fused_push:
            self._launch(x_shard.contiguous(), None, None, epoch, push=True, compute=False, pushers=False)
        return epoch

    def refuse_call(self, refused: RefusedCall) -> None:
        """Raise refused.error after a call of no exchange (an x_shard of no shape class, an unknown producer: the
        module docstring): its number taken among the workspace's calls, its signature published into every peer,
        then a wait for every peer's call (the guard of the signatures' halves), and the exchange that the peers'
        call used caught up (`_catch_up`). This op lends its calls' buffer (every shape class's) and error word;
        its own calls' state is untouched."""
        self.errors.check()
        call = self.ws.next_epoch(CALLS)
        self._refused_call(refused.signature, call, 0, None, publish=True, wait=True)
        self._catch_up(call)
        raise refused.error

    def _catch_up(self, call: int) -> None:
        """After this rank's call `call` of no exchange (`refuse_call`): the exchange that every peer's call used
        (their signatures, or a refused call's description of its exchange, read behind the wait for them: a host
        sync, in a call that raises anyway) takes its next epoch here too, where that is the peers' one, and
        acknowledges it as a refused call of that exchange does (reading nothing of it), so its epochs stay in step
        and its next call is exact. Nothing where the peers' calls name no one exchange (calls unlike each other,
        all of no exchange, or one never published: a wait that gave up) or this rank holds none such (on GPUs the
        peers' call could not have allocated it without this rank)."""
        signatures, descriptions = self.calls.local[:calls_numel(self.world)].view(2, 2, self.world, -1)[:, call % 2]
        described = set()
        for rank, (words, description) in enumerate(zip(signatures.tolist(), descriptions.tolist())):
            if rank == self.rank:
                continue
            if words[0] != call:
                return
            if words[1] != REFUSED_CALL:
                described.add(tuple(words[1:7]))
            elif description[0] == call:  # a refused call of an exchange (a call of none describes none)
                described.add(tuple(description[1:7]))
        if len(described) != 1:
            return
        *theirs, epoch = described.pop()
        rows, k, dtype = theirs[:3]
        gather = next((g for op in _OPS.get(self.ws, {}).values() for mine, g in op._exchanges() if mine == theirs),
                      None)
        if rows and gather is None:
            return
        exchange = gather.exchange if rows else empty_calls(k, DTYPES[dtype - 1])
        if self.ws.epoch(exchange) == epoch - 1:
            self.ws.next_epoch(exchange)
            if gather is not None:
                self._refused_call(self.calls.local, call, epoch, gather, ack=True)  # (the signature is not read)

    def _empty_epoch(self) -> int:
        """The epoch of a call of empty shards: the count of such calls of this K and dtype (no exchange)."""
        return self.ws.next_epoch(empty_calls(self.k, self.dtype))

    def _refused_call(self, signature: torch.Tensor, call: int, epoch: int, gather: SymmetricAllGather | None,
                      publish: bool = False, ack: bool = False, wait: bool = False,
                      described: tuple[int, int, int, int, int] | None = None) -> None:
        """`_refused_call_kernel` of call `call` (`epoch`: its exchange's, gather's) through this op's calls'
        buffer and error word: its publish and ack (`start`, described: its exchange, `_described`), its wait
        (`finish`), or both of a call of no exchange (`refuse_call`), or the ack that catches an exchange up
        (`_catch_up`)."""
        acks = gather.ack.peer_ptrs if gather else self.calls.peer_ptrs  # (no exchange: nothing acknowledged)
        _refused_call_kernel[(1,)](signature, self.calls.peer_ptrs, self.calls.local, acks, self.rank, call, epoch,
                                   *(described or (0,) * 5), self.config.spin_limit, self.errors.word,
                                   WORLD=self.world, PUBLISH=publish, DESCRIBE=described is not None, ACK=ack,
                                   WAIT=wait)

    def _exchanges(self) -> list[tuple[list[int], SymmetricAllGather]]:
        """The exchanges this op has built (none for empty shards; the copy engines' once used), each with what a
        call through it says of it (`_described`)."""
        return [(list(self._described(p)), g) for p, g in (("device", self.gather), ("copy_engine", self._copy_gather))
                if g is not None]

    def _described(self, producer: str) -> tuple[int, int, int, int, int]:
        """The kernels' arguments that describe a call by `producer` (`_call_signature`): rows, K, dtype, producer
        and rows per chunk of its exchange (0: empty shards have none)."""
        g = self.gather_for(producer)
        return self.rows, self.k, dtype_code(self.dtype), GEMM_PRODUCERS.index(producer), g.chunk_rows if g else 0

    def finish(self, epoch: int, x_shard: torch.Tensor, weight: torch.Tensor, producer: str,
               return_gathered: bool = False, out: torch.Tensor | None = None):
        """The call's product (and gathered input with return_gathered); a call this rank refused (`start`) raises
        its error here, behind a wait (on its stream) for every peer's call."""
        g = self.gather_for(producer)
        if self.refused is not None:
            self._refused_call(self.refused.signature, self.call, epoch, g, wait=True)
            raise self.refused.error
        x_shard = tma_readable(x_shard)  # as the tiles read it; copied, not refused: the call has begun
        check_weight(weight, self.k, x_shard.dtype)
        out = output(out, self.world * self.rows, weight.shape[1], x_shard)
        if producer == "copy_engine" or not self.rows:
            _check_calls_kernel[(1,)](self.calls.local, self.rank, self.call, *self._described(producer), epoch,
                                      self.config.spin_limit, self.errors.word, WORLD=self.world)
        if not self.rows:
            self.errors.after_wait()
            return (out, x_shard.new_empty(0, self.k)) if return_gathered else out
        if producer == "copy_engine":
            g.pull_published(epoch)
        self._launch(x_shard, weight, out, epoch, producer == "device" and self.fused_push, True,  # push, compute
                     producer == "device", g)  # pushers, the exchange
        g.join()
        self.errors.after_wait()
        if not return_gathered:
            return out
        # After the launch: every peer chunk has arrived; the half is overwritten only two calls later.
        gathered = g.gathered(epoch).clone()
        gathered[self.rank * self.rows:(self.rank + 1) * self.rows] = x_shard  # device push leaves it unwritten
        return out, gathered

    def lead(self, n: int, pushers: bool = True) -> tuple[int, int]:
        """(programs that do not push, local tiles dealt among them alone first) for an output of n columns;
        pushers=False (copy-engine producer): (all programs, 0). A simulated world's device producer pushes in a
        launch of its own, and its compute launch deals the tiles as on GPUs, so the interpreter tests walk the
        production deal."""
        c = self.config
        if not pushers:
            return self.num_programs, 0
        lead_programs = self.num_programs - min(self.num_programs, (self.world - 1) * self.gather.chunks)
        local_tiles = triton.cdiv(self.rows, c.block_m) * triton.cdiv(n, c.block_n)
        rounds = lead_rounds(self.world, self.rows, self.k, self.gather.dtype.itemsize, c)
        return lead_programs, min(rounds * lead_programs, local_tiles)

    def _launch(self, x, weight, out, epoch, push: bool, compute: bool, pushers: bool,
                gather: SymmetricAllGather | None = None) -> None:
        """push: this launch pushes the shard; pushers: the device producer's programs push (in this launch or,
        in a simulated world, in one of their own), so the compute deals them fewer tiles (`lead`)."""
        g, c = gather or self.gather, self.config
        producer = "device" if g is self.gather else "copy_engine"
        n, w_nk, descriptors = 0, False, (None, None, None)
        if compute:
            self.launches += 1
            n, w_nk = weight.shape[1], check_weight(weight, self.k, x.dtype)
            descriptors = (descriptor(x.view(1, self.rows, self.k), [1, c.block_m, c.block_k], "x_shard"),
                           descriptor(g.gathered(epoch).view(self.world, self.rows, self.k),
                                      [1, c.block_m, c.block_k], "the gathered buffer"),
                           descriptor(weight.t() if w_nk else weight,
                                      [c.block_n, c.block_k] if w_nk else [c.block_k, c.block_n], "weight"))
        lead_programs, lead_tiles = self.lead(n, pushers)
        _all_gather_matmul_kernel[(self.num_programs,)](
            x, *descriptors, x if out is None else out,
            g.data.peer_ptrs, g.ready.local, g.ready.peer_ptrs, g.ack.local, g.ack.peer_ptrs,
            self.counter, self.errors.word, self.calls.local, self.calls.peer_ptrs, self.rows, self.k, n,
            self.rank, epoch, self.call, *self._described(producer)[2:], g.chunks, g.half_offset(epoch),
            self.num_programs, lead_programs, lead_tiles, c.spin_limit, self.launches * self.num_programs,
            WORLD=self.world, PUSH=push, COMPUTE=compute,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, K_TILES=triton.cdiv(self.k, c.block_k),
            GROUP_M=c.group_m, PUSH_R=g.block_rows, PUSH_C=g.block_cols, W_NK=w_nk, ON_GPU=not interpreting(),
            num_warps=c.num_warps, num_stages=c.num_stages)


def weight_problem(weight: torch.Tensor, k: int, dtype: torch.dtype) -> str | None:
    """Why the GEMM cannot read weight [K, N] as it lies (N or K contiguous, rows TMA reads), or None."""
    if weight.dim() != 2 or weight.shape[0] != k or weight.dtype != dtype:
        return f"weight {tuple(weight.shape)} {weight.dtype}: expected ({k}, N) {dtype}"
    return tma_problem(weight.t() if weight.stride(1) != 1 else weight, "all_gather_matmul's weight (as it lies)")


def check_weight(weight: torch.Tensor, k: int, dtype: torch.dtype) -> bool:
    """Raise unless the GEMM can read weight [K, N] (before any work is done); returns whether it reads it as a
    Linear's weight.t() (K contiguous: blocks transposed in shared memory) rather than N contiguous."""
    problem = weight_problem(weight, k, dtype)
    if problem is not None:
        raise ValueError(problem)
    return weight.stride(1) != 1


def out_problem(out: torch.Tensor | None, m: int, n: int, x_shard: torch.Tensor) -> str | None:
    """Why `out` cannot take the product [m, n]: the kernel stores rows of n values from out's start (x_shard's
    dtype), so an out of other rows, strides or dtype would be stored past its end or between its values; None
    where it can (None: a new tensor)."""
    if out is None or (out.shape == (m, n) and out.dtype == x_shard.dtype and out.device == x_shard.device
                       and out.is_contiguous()):
        return None
    return (f"out must be contiguous {x_shard.dtype} [{m}, {n}] on {x_shard.device} (world x rows, N); got "
            f"{out.dtype} {list(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")


def output(out: torch.Tensor | None, m: int, n: int, x_shard: torch.Tensor) -> torch.Tensor:
    """out, checked (`out_problem`); None: a new tensor."""
    problem = out_problem(out, m, n, x_shard)
    if problem is not None:
        raise ValueError(problem)
    return torch.empty((m, n), dtype=x_shard.dtype, device=x_shard.device) if out is None else out


def empty_calls(k: int, dtype: torch.dtype) -> str:
    """What counts the epochs of calls of empty shards of this K and dtype (no exchange: `_empty_epoch`)."""
    return f"allgather_matmul:0x{k}:{dtype}"


def shard_problem(shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why the op takes no x_shard of this shape and dtype (it has no shape class), or None."""
    if len(shape) != 2:
        return f"all_gather_matmul: x_shard {shape}: expected [rows, K]"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"all_gather_matmul: dtype {dtype} (expected fp16 or bf16)"
    if shape[1] % 8:
        return (f"all_gather_matmul: K={shape[1]} is not a multiple of 8: the GEMM reads the rows through TMA, whose "
                f"rows must be a multiple of 16 bytes")
    return None


# Why a rank refuses its call (`refused_call`, `all_gather_matmul`): word 0 of its refusal words, which its peers
# name (`describe_refusal`)
UNREADABLE_WEIGHT, UNUSABLE_OUT, FOREIGN_OPERAND, UNTAKEN_SHARD, UNKNOWN_PRODUCER, UNRESIDENT_GRID = 1, 2, 3, 4, 5, 6
OPERANDS = ("x_shard", "weight", "out")  # a call's tensors, as `foreign_operand`'s words name them


def grid_problem(num_programs: int, resident: int | None) -> str | None:
    """Why the device push cannot run on a grid of num_programs where a launch that pushes and computes holds
    `resident` programs at once (None: the push has a launch of its own, any grid), or None. Its pushers are the
    last programs: not resident, they start only once a resident program is done, and those wait for the peers'
    chunks, whose pushers wait likewise, until every wait runs out its bound."""
    if resident is None or num_programs <= resident:
        return None
    return (f"GemmConfig.num_programs={num_programs}: the device push runs in the GEMM's launch, whose programs wait "
            f"for each other's chunks, so every one must be resident at once: at most {resident} on this GPU (one "
            f"per SM); use fewer programs, or producer='copy_engine' (no wait inside its launch)")


def refused_call(x_shard: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, op: AllGatherMatmul,
                 producer: str) -> RefusedCall | None:
    """The call this rank refuses, for an x_shard, weight or out on another device than the op's buffers, or a
    weight or out that the GEMM cannot read or store into (what each rank's own tensors decide: N may differ between
    ranks), or a device push on a grid the GPU does not hold at once (`grid_problem`: the grid is each rank's own
    too, so a rank raising alone would leave its peers waiting out their bounds), or None. x_shard is one of the
    op's shape class."""
    device = op.calls.local.device  # the workspace's, with its index ("cuda:0", where the workspace's is "cuda")
    foreign = foreign_operand(dict(zip(OPERANDS, (x_shard, weight, out))), device)
    if foreign is not None:
        words, error = foreign
        return RefusedCall.of([FOREIGN_OPERAND] + words, error, device)
    k, dtype = x_shard.shape[1], x_shard.dtype
    problem = weight_problem(weight, k, dtype)
    if problem is not None:
        strides = list(weight.stride()[:2]) + [-1] * (2 - min(weight.dim(), 2))
        return RefusedCall.of([UNREADABLE_WEIGHT, k, dtype_code(dtype)] + tensor_words(weight) + strides,
                              ValueError(problem), device)
    m, n = op.world * x_shard.shape[0], weight.shape[1]
    problem = out_problem(out, m, n, x_shard)
    if problem is not None:
        return RefusedCall.of([UNUSABLE_OUT, m, n, dtype_code(dtype)] + tensor_words(out) + [int(out.is_contiguous())],
                              ValueError(problem), device)
    problem = grid_problem(op.num_programs, op.resident_programs) if producer == "device" else None
    if problem is not None:
        return RefusedCall.of([UNRESIDENT_GRID, op.num_programs, op.resident_programs], ValueError(problem), device)
    return None


def describe_refusal(words: list[int]) -> str:
    """A rank's refusal words (`refused_call`) in words, as its peers say them."""
    reason, *values = words
    if reason == FOREIGN_OPERAND:
        return describe_foreign(OPERANDS, values)
    if reason == UNTAKEN_SHARD:
        return (f"its x_shard {describe_tensor(values)} is not one the op takes: [rows, K] float16 or bfloat16, K a "
                f"multiple of 8")
    if reason == UNKNOWN_PRODUCER:  # (its name does not travel: the words are integers)
        return f"its producer is not one of {GEMM_PRODUCERS}"
    if reason == UNRESIDENT_GRID:
        programs, resident = values[:2]
        return (f"its device push's grid of {programs} programs is more than its GPU holds at once ({resident}: one "
                f"per SM)")
    if reason == UNREADABLE_WEIGHT:
        (k, dtype), weight, strides = values[:2], values[2:2 + TENSOR_WORDS], values[2 + TENSOR_WORDS:][:2]
        shown = ", ".join(str(s) for s in strides[:weight[0]])
        return (f"its weight {describe_tensor(weight)} (strides {shown}) is not one the GEMM reads: expected "
                f"[{k}, N] {dtype_name(dtype)}, N or K contiguous, rows of a multiple of 16 bytes")
    (m, n, dtype), out, contiguous = values[:3], values[3:3 + TENSOR_WORDS], values[3 + TENSOR_WORDS]
    return (f"its out {describe_tensor(out)}{'' if contiguous else ', not contiguous,'} cannot take its product: "
            f"contiguous [{m}, {n}] {dtype_name(dtype)}")


_OPS: "weakref.WeakKeyDictionary[_Workspace, dict]" = weakref.WeakKeyDictionary()


def op_for(workspace: _Workspace, x_shard: torch.Tensor, config: GemmConfig | None = None) -> AllGatherMatmul:
    """The workspace's op for x_shard's shape class (buffers and flags are allocated once per shape class)."""
    config = config or GemmConfig()
    ops = _OPS.setdefault(workspace, {})
    key = (tuple(x_shard.shape), x_shard.dtype, config)
    if key not in ops:
        ops[key] = AllGatherMatmul(workspace, x_shard.shape[0], x_shard.shape[1], x_shard.dtype, config)
    return ops[key]


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, workspace: _Workspace,
                      producer: str = "device", *, return_gathered: bool = False,
                      out: torch.Tensor | None = None, config: GemmConfig | None = None):
    """all_gather(x_shard) @ weight over the workspace's group; x_shard [rows, K] (same rows on every rank, K a
    multiple of 8), weight [K, N] with N or K contiguous (e.g. a Linear's weight.t()) and rows of a multiple of 16
    bytes as it lies. Every rank calls with the same shapes and producer (else every rank raises PeerCallMismatch,
    naming both calls: the module docstring; N may differ). The device push is the default: at
    issue 5's shape on 2 GPUs it took 741 against 1,295 us for the copy engines' pulls (2×H200, 2026-11-24) and
    733 against 1,440 (2×H100, 2026-11-26; docs/benchmarks.md). A shard of 0 rows (every rank's, as the shapes
    are alike: an empty batch) gives empty outputs and exchanges no data, but is a call (its signature compared
    with the peers'), as the GEMM + all-reduce's for M = 0. A weight or out this rank refuses, an x_shard, weight or
    out on another device than the workspace's, or a device push on more programs than SMs (`grid_problem`), raises
    its ValueError here and PeerRefusedInput on its peers; so does an x_shard of no shape class or an unknown
    producer, after which this rank catches up the exchange its peers used (the module docstring)."""
    problem = shard_problem(tuple(x_shard.shape), x_shard.dtype)
    if problem is not None:  # a call of no shape class, through any op of the workspace
        refused = RefusedCall.of([UNTAKEN_SHARD] + tensor_words(x_shard), ValueError(problem), workspace.device)
        ops = _OPS.get(workspace)
        if ops:
            next(iter(ops.values())).refuse_call(refused)
        # none: this rank's first call, whose peers' first op allocates CALLS first: refused in its place
        try:
            workspace.refuse_allocation(AllocationRequest(CALLS, calls_numel(workspace.world_size), torch.int64,
                                                          problem))
        except AllocationRefused:
            pass  # (every rank raises it; this one its own error)
        raise refused.error
    op = op_for(workspace, x_shard, config)
    # before the producer starts: a refused call tells its peers why
    refused = refused_call(x_shard, weight, out, op, producer)
    return op.finish(op.start(x_shard, producer, refused), x_shard, weight, producer, return_gathered, out)
