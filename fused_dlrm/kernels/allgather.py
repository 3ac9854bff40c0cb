"""All-gather over symmetric memory: every rank's shard [rows, cols] lands in slot `rank` of every rank's buffer.

Layout (per `SymmetricAllGather`, all in the workspace): data = 2 halves (epoch parity) x [world, rows, cols];
ready flags [world * chunks], one per (source rank, chunk of `chunk_rows` rows), carrying the epoch of the data
behind them (never reset, compared with `>=`); ack [world]: ack[d] = the last epoch rank d has received from us.
The guard: epoch e writes half e % 2 of a peer, last used by e - 2; the producer waits for ack >= e - 1 from that
peer (it has received e - 1, so by its stream order it has finished reading e - 2), `peer_flags.consumer_released`.

Producers (`start`):
- "device": a Triton kernel whose programs store chunks into every peer's slot, remote peers first, rotated by
  rank (`peer_tiles.remote_first_order`), the local slot last, then raise the chunk's flag (release, system scope).
- "copy_engine": per peer, on its own side stream, `copy_` of each chunk into the peer's slot (a peer view of the
  symmetric buffer, so the copy engine does it, not the SMs) followed on that stream by
  `torch.ops.symm_mem.stream_write_value32_` of the epoch into the peer's flag (cuStreamWriteValue32 fences first).
- "pull": each rank copies its shard into its own slot and raises its own flags; in `finish` every rank waits for
  each peer's chunk flag (a one-program wait kernel on a side stream) and copies the chunk from the peer's slot.
  `pull_published` is the variant for a persistent consumer kernel (AllGather + GEMM): one wait for every peer's
  published shard on the current stream, then copy-engine pulls on the side streams, each chunk followed by this
  rank's own flag. Data and flag are then both written into this GPU's memory by this GPU's stream, in order (the
  pattern of torch's own fused_all_gather_matmul); no spinning kernel sits on a side stream.
Caveat of "copy_engine" (push): the flag is a stream memory op into the peer's memory after a copy-engine write into
the peer's memory; nothing here checks that the data is visible at the peer when the flag is (the GPU primitive
test snapshots the result right after the wait to look for it). The fused GEMM does not rely on it. Nor does a
guard that gave up (a peer late by two calls) stop the copies and flags that follow it, as the device push's does.
In the simulated CPU world there are no copy engines or streams: "copy_engine" and "pull" are plain tensor copies
and flag writes in the same order (a stand-in), while the guard and wait kernels, and "device", run their real
kernels in the interpreter.

Consumer (`finish`): the project's wait kernel (`peer_flags.wait_ready`) polls every (source, chunk) flag, bounded,
and acknowledges the epoch to each source; a timeout becomes a PeerWaitTimeout naming rank, source and chunk.
The gathered tensor returned is a view of the symmetric buffer: valid until the next call on this object.
`all_gather_reference` is the pure-torch definition. Every rank must build the exchange alike (rows, cols, dtype,
chunk_rows) and call in the same order: calls are not compared here (AllGatherMatmul compares its calls'
signatures). A shard of 0 rows is one chunk of none: its call raises and waits for a flag per rank, as any call.

A call that one rank refuses (`SymmetricAllGather.refusal`: an unknown producer, a shard not [rows, cols] of the
exchange's dtype on its device) is still a call there (peer_flags.RefusedCall): raising alone would leave its peers
waiting for its chunks, and its epochs behind theirs for good. It takes its epoch, and `_refused_call_kernel` puts
a signature that says why ([epoch, REFUSED_CALL, refusal words]) into every rank's refusals' buffer (two halves by
epoch parity, guarded as the data: once the rank acknowledged epoch - 1), then raises the flags of every chunk
there and acknowledges the epoch (it reads nothing of it); its host raises its own ValueError. Each peer's
`finish`, after its wait, reads the signatures of that epoch (`_refused_sources_kernel`: a good call writes none)
and records the lowest refusing rank (code 5), so its PeerErrors raises PeerRefusedInput naming the rank and why
(at once on the CPU, within check_every calls on GPUs); its gathered rows are not defined. The next call is exact.
An op that passes its own `errors` (AllGatherMatmul) checks its shards first: its error word describes its own
refusals, and with refusals=False its exchanges hold no refusals' buffer (a call that reaches one all the same is
a bug of the op: RuntimeError, before its epoch is taken).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import _Workspace
from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.peer_flags import (DEFAULT_SPIN_LIMIT, SIGNATURE_WORDS, TENSOR_WORDS, PeerErrors, RefusedCall,
                                           check_spin_limit, consumer_released, describe_refused_calls,
                                           describe_tensor, publish_refusal, refused_by, signal_peer, signal_ready,
                                           tensor_words, wait_or_record, wait_ready)
from fused_dlrm.kernels.peer_tiles import remote_first_order

PRODUCERS = ("device", "copy_engine", "pull")


def all_gather_reference(shards: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(shards)


@triton.jit
def wait_chunk(ready_ptr, source, chunk, chunks, epoch, spin_limit, error_ptr):
    """Bounded wait until flag (source, chunk) at ready_ptr >= epoch; a timeout records (1, source, chunk)."""
    return wait_or_record(ready_ptr + source * chunks + chunk, epoch, spin_limit, error_ptr, source, chunk)


@triton.jit
def push_chunk(x_ptr, data_ptrs, ready_ptrs, ack_ptr, error_ptr, dest, chunk, rank, epoch, rows, cols, chunk_rows,
               chunks, half_offset, spin_limit, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store rows of `chunk` of the local shard x [rows, cols] into slot `rank` of dest's buffer half, then raise
    flag (rank, chunk) in dest. Stores are skipped (and the error recorded) if dest never released the half, and
    then so is the flag (dest would read the chunk of the call before last as this one's)."""
    released = consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
    dst = tl.load(data_ptrs + dest).to(tl.pointer_type(x_ptr.dtype.element_ty)) + half_offset
    dst += tl.cast(rank, tl.int64) * rows * cols  # tl.cast: an argument equal to 1 arrives as a constexpr
    first = chunk * chunk_rows
    end = tl.minimum(first + chunk_rows, rows)
    r = first
    while r < end:
        rr = r + tl.arange(0, BLOCK_R)
        c = 0
        while c < cols:
            cc = c + tl.arange(0, BLOCK_C)
            mask = (rr < end)[:, None] & (cc < cols)[None, :] & released
            offs = rr.to(tl.int64)[:, None] * cols + cc[None, :]
            tl.store(dst + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
            c += BLOCK_C
        r += BLOCK_R
    if released:
        signal_peer(ready_ptrs, dest, rank * chunks + chunk, epoch)


@triton.jit(do_not_specialize=["epoch"])  # one compiled variant for every epoch
def _push_kernel(x_ptr, data_ptrs, ready_ptrs, ack_ptr, error_ptr, rank, epoch, rows, cols, chunk_rows, chunks,
                 half_offset, num_items, num_programs, spin_limit,
                 WORLD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    while i < num_items:  # item i: chunk i % chunks for the (i // chunks)-th destination of the remote-first order
        dest = (rank + 1 + i // chunks) % WORLD
        push_chunk(x_ptr, data_ptrs, ready_ptrs, ack_ptr, error_ptr, dest, i % chunks, rank, epoch, rows, cols,
                   chunk_rows, chunks, half_offset, spin_limit, BLOCK_R, BLOCK_C)
        i += num_programs


@triton.jit(do_not_specialize=["rank", "epoch"])  # one compiled variant for every rank and epoch
def _guard_kernel(ack_ptr, rank, epoch, spin_limit, error_ptr):
    """One program per rank d: wait until d has released the half of its buffer that `epoch` writes. Peers come
    first, this rank last: the first timeout is the one recorded, and a peer's is the likely cause (this rank's
    own ack of epoch - 1 is late only if its own calls were out of order)."""
    dest = (rank + 1 + tl.program_id(0)) % tl.num_programs(0)
    consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)


@triton.jit(do_not_specialize=["epoch"])  # one compiled variant for every epoch
def _wait_chunk_kernel(ready_ptrs, source, chunk, chunks, epoch, spin_limit, error_ptr):
    """Wait for flag (source, chunk) in the source's own flags (the pull reads the source's buffer)."""
    wait_chunk(tl.load(ready_ptrs + source).to(tl.pointer_type(tl.int32)), source, chunk, chunks, epoch,
               spin_limit, error_ptr)


@triton.jit(do_not_specialize=["epoch"])  # one compiled variant for every epoch
def _wait_published_kernel(ready_ptrs, rank, chunks, epoch, spin_limit, error_ptr):
    """Program s != rank: wait until rank s has published every chunk of `epoch` (its own flags (s, chunk))."""
    source = tl.program_id(0)
    if source != rank:
        flags = tl.load(ready_ptrs + source).to(tl.pointer_type(tl.int32))
        c = 0
        while c < chunks:
            wait_chunk(flags, source, c, chunks, epoch, spin_limit, error_ptr)
            c += 1


@triton.jit
def _refusals_half(epoch, WORLD: tl.constexpr):
    """The offset of `epoch`'s half of the refusals' buffer (by its parity: the call after next reuses it)."""
    return (epoch % 2) * WORLD * SIGNATURE_WORDS


@triton.jit(do_not_specialize=["rank", "epoch"])
def _refused_call_kernel(signature_ptr, refusal_ptrs, ready_ptrs, ack_ptr, ack_ptrs, error_ptr, rank, epoch, chunks,
                         spin_limit, WORLD: tl.constexpr, SLOTS: tl.constexpr):
    """One program: a call this rank refused (the module docstring). Into every rank, once it has released the half
    (`consumer_released`: it has checked the refusals that `epoch` - 2 left there), this rank last (a pull's
    consumer waits for this rank's own flags, then reads the signature in its own buffer): the signature that says
    why (signature_ptr: a RefusedCall's), then the flags of every chunk (`publish_refusal`). Then the epoch
    acknowledged to every rank, as its `finish` would: it reads nothing of it."""
    for k in tl.static_range(1, WORLD + 1):
        dest = (rank + k) % WORLD
        if consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr):
            publish_refusal(signature_ptr, epoch, refusal_ptrs, _refusals_half(epoch, WORLD), ready_ptrs, dest, rank,
                            chunks, SLOTS)
    signal_ready(ack_ptrs, rank, epoch, WORLD)


@triton.jit(do_not_specialize=["rank", "epoch"])
def _refused_sources_kernel(refusals_ptr, error_ptr, rank, epoch, WORLD: tl.constexpr):
    """One program, after the wait for every chunk of `epoch`: record (code 5, `refused_by`) the lowest peer that
    refused the call. A refusal's signature holds its epoch; a source's good calls write none, so an older one
    may lie in the half."""
    refusals = refusals_ptr + _refusals_half(epoch, WORLD)
    for source in tl.static_range(WORLD):
        if source != rank:
            if tl.load(refusals + source * SIGNATURE_WORDS) == epoch:
                refused_by(refusals, source, error_ptr, epoch)


# Why a rank refuses its call (`SymmetricAllGather.refusal`): word 0 of its refusal words, which its peers name
# (`describe_refusal`)
UNKNOWN_PRODUCER, UNEXPECTED_SHARD = 1, 2


def describe_refusal(words: list[int]) -> str:
    """A rank's refusal words (`SymmetricAllGather.refusal`) in words, as its peers say them."""
    reason, *values = words
    if reason == UNKNOWN_PRODUCER:  # (its name does not travel: the words are integers)
        return f"its producer is not one of {PRODUCERS}"
    shard, (on_device, rows, cols, dtype) = values[:TENSOR_WORDS], values[TENSOR_WORDS:TENSOR_WORDS + 4]
    return (f"its shard {describe_tensor(shard)}{'' if on_device else ' on another device'} is not the exchange's "
            f"[{rows}, {cols}] {dtype_name(dtype)} on its device")


def _write_flag(flags: torch.Tensor, index: int, epoch: int) -> None:
    """On the current stream, after its earlier work: flags[index] = epoch (a stream memory op on GPUs)."""
    if flags.is_cuda:
        torch.ops.symm_mem.stream_write_value32_(flags.view(torch.uint32), index, epoch)
    else:
        flags[index] = epoch


class SymmetricAllGather:
    """All-gather of a [rows, cols] shard per rank into every rank's symmetric buffer [world * rows, cols]."""

    def __init__(self, workspace: _Workspace, rows: int, cols: int, dtype: torch.dtype, chunk_rows: int | None = None,
                 name: str = "allgather", num_programs: int | None = None, spin_limit: int = DEFAULT_SPIN_LIMIT,
                 block_rows: int = 16, block_cols: int = 512, errors: PeerErrors | None = None,
                 refusals: bool = True):
        """errors: the error word to report into (shared by the exchanges of one op); None: a new one. refusals:
        False where the owner refuses its calls itself before they reach the exchange (AllGatherMatmul: its own
        signatures say why): no refusals' buffer (a collective allocation fewer), and `start` takes no call it would
        refuse."""
        check_spin_limit(spin_limit, "spin_limit")
        self.ws, self.rank, self.world = workspace, workspace.rank, workspace.world_size
        self.rows, self.cols, self.dtype = rows, cols, dtype
        self.chunk_rows = max(1, min(chunk_rows or rows, rows))
        # A shard of 0 rows is one chunk of none: its call, as any, raises and waits for a flag per rank (no chunk
        # at all would leave it nothing to wait for, and the wait kernel no block to poll).
        self.chunks = max(1, triton.cdiv(rows, self.chunk_rows))
        self.exchange = f"{name}:{rows}x{cols}:{dtype}:{self.chunk_rows}"  # one set of buffers per shape class
        self.data = workspace.buffer(self.exchange, 2 * self.world * rows * cols, dtype)
        self.ready = workspace.buffer(self.exchange + ":ready", self.world * self.chunks, torch.int32)
        self.ack = workspace.buffer(self.exchange + ":ack", self.world, torch.int32)
        # every source's signature of its latest refused call, two halves by epoch parity (`_refused_call_kernel`)
        self.refusals = workspace.buffer(self.exchange + ":refusals", 2 * self.world * SIGNATURE_WORDS.value,
                                         torch.int64) if refusals else None
        self.errors = errors or PeerErrors(workspace.device, self.rank, "all-gather",
                                           describe_refused=describe_refused_calls(self.rank, describe_refusal))
        cuda = workspace.device.type == "cuda"
        self.num_programs = num_programs or (
            torch.cuda.get_device_properties(workspace.device).multi_processor_count if cuda else 2)
        self.spin_limit, self.block_rows, self.block_cols = spin_limit, block_rows, block_cols
        self._streams = ({d: torch.cuda.Stream(workspace.device) for d in range(self.world) if d != self.rank}
                         if cuda else {})  # one side stream per peer
        self._peer_data = self._peer_ready = None  # peer tensors, built on the first copy-engine call

    # -- layout ---------------------------------------------------------------------------------------------------
    def next_epoch(self) -> int:
        return self.ws.next_epoch(self.exchange)

    def half_offset(self, epoch: int) -> int:
        """Element offset of the half of the data buffer that `epoch` uses."""
        return (epoch % 2) * self.world * self.rows * self.cols

    def gathered(self, epoch: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """[world * rows, cols] view of `epoch`'s half of a rank's data buffer (default: this rank's)."""
        base = self.half_offset(epoch)
        buffer = self.data.local if buffer is None else buffer
        return buffer[base:base + self.world * self.rows * self.cols].view(self.world * self.rows, self.cols)

    def _chunk_rows(self, chunk: int) -> slice:
        return slice(chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.rows))

    def _side(self, peer: int, reads: torch.Tensor | None = None):
        """The side stream of one peer's copies (GPU), after everything already on the current stream; `reads`
        stays allocated until the copies that read it have run."""
        if not self._streams:
            return contextlib.nullcontext()
        stream = self._streams[peer]
        stream.wait_stream(torch.cuda.current_stream())
        if reads is not None:
            reads.record_stream(stream)
        return torch.cuda.stream(stream)

    def join(self) -> None:
        """The current stream waits for the side streams."""
        for stream in self._streams.values():
            torch.cuda.current_stream().wait_stream(stream)

    # -- producers ------------------------------------------------------------------------------------------------
    def refusal(self, shard: torch.Tensor, producer: str) -> RefusedCall | None:
        """The call this rank refuses (an unknown producer; a shard not [rows, cols] of the exchange's dtype on its
        device), or None."""
        if producer not in PRODUCERS:
            return RefusedCall.of([UNKNOWN_PRODUCER], ValueError(f"unknown producer {producer!r}: expected one of "
                                                                 f"{PRODUCERS}"), self.ws.device)
        device = self.data.local.device  # the workspace's, with its index ("cuda:0", where the workspace's is "cuda")
        if tuple(shard.shape) != (self.rows, self.cols) or shard.dtype != self.dtype or shard.device != device:
            error = ValueError(f"shard {tuple(shard.shape)} {shard.dtype} on {shard.device}: expected ({self.rows}, "
                               f"{self.cols}) {self.dtype} on {device}")
            words = tensor_words(shard) + [int(shard.device == device), self.rows, self.cols, dtype_code(self.dtype)]
            return RefusedCall.of([UNEXPECTED_SHARD] + words, error, self.ws.device)
        return None

    def start(self, shard: torch.Tensor, producer: str) -> int:
        """Enqueue this rank's part of the next all-gather (its own slot included); returns its epoch. A call this
        rank refuses (`refusal`) takes its epoch all the same and tells every rank why (the module docstring), then
        raises its error here; its peers raise PeerRefusedInput at `finish`."""
        self.errors.check()
        refused = self.refusal(shard, producer)
        if refused is not None and self.refusals is None:  # the owner's checks let through what it must refuse
            raise RuntimeError(f"{self.exchange}: a call that its owner refuses itself reached it: {refused.error}")
        epoch = self.next_epoch()
        if refused is not None:
            _refused_call_kernel[(1,)](refused.signature, self.refusals.peer_ptrs, self.ready.peer_ptrs,
                                       self.ack.local, self.ack.peer_ptrs, self.errors.word, self.rank, epoch,
                                       self.chunks, self.spin_limit, WORLD=self.world,
                                       SLOTS=triton.next_power_of_2(self.chunks))
            raise refused.error
        shard = shard.contiguous()
        if producer == "device":
            self.launch_push(shard, epoch)
        elif producer == "copy_engine":
            self._copy_engine_push(shard, epoch)
        else:
            self._publish_local(shard, epoch)
        return epoch

    def launch_push(self, shard: torch.Tensor, epoch: int) -> None:
        items = self.world * self.chunks
        programs = max(1, min(self.num_programs, items))
        _push_kernel[(programs,)](
            shard, self.data.peer_ptrs, self.ready.peer_ptrs, self.ack.local, self.errors.word, self.rank, epoch,
            self.rows, self.cols, self.chunk_rows, self.chunks, self.half_offset(epoch), items, programs,
            self.spin_limit, WORLD=self.world, BLOCK_R=self.block_rows, BLOCK_C=self.block_cols)

    def _peers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._peer_data is None:
            self._peer_data, self._peer_ready = self.ws.peer_tensors(self.data), self.ws.peer_tensors(self.ready)
        return self._peer_data, self._peer_ready

    def _copy_engine_push(self, shard: torch.Tensor, epoch: int) -> None:
        data, ready = self._peers()
        remote = remote_first_order(self.rank, self.world)[:-1]
        # One guard launch on the current stream for every rank: a spinning kernel on a side stream could be
        # starved of SMs by a persistent consumer launched after it.
        _guard_kernel[(self.world,)](self.ack.local, self.rank, epoch, self.spin_limit, self.errors.word)
        self._copy_chunks(shard, data[self.rank], ready[self.rank], epoch)
        for dest in remote:
            with self._side(dest, reads=shard):
                self._copy_chunks(shard, data[dest], ready[dest], epoch)

    def _copy_chunks(self, shard: torch.Tensor, data: torch.Tensor, ready: torch.Tensor, epoch: int) -> None:
        """Chunk by chunk, the shard into slot `rank` of one rank's data buffer, each followed by its flag there."""
        slot = self.gathered(epoch, data)[self.rank * self.rows:(self.rank + 1) * self.rows]
        for chunk in range(self.chunks):
            rows = self._chunk_rows(chunk)
            slot[rows].copy_(shard[rows], non_blocking=True)
            _write_flag(ready, self.rank * self.chunks + chunk, epoch)

    def _publish_local(self, shard: torch.Tensor, epoch: int) -> None:
        """Pull: the shard into this rank's own slot (once every peer is done with that half), then its flags."""
        _guard_kernel[(self.world,)](self.ack.local, self.rank, epoch, self.spin_limit, self.errors.word)
        self._copy_chunks(shard, self.data.local, self.ready.local, epoch)

    def _pull(self, epoch: int) -> None:
        data, _ = self._peers()
        for source in remote_first_order(self.rank, self.world)[:-1]:
            theirs = self.gathered(epoch, data[source])
            mine = self.gathered(epoch)
            with self._side(source):
                for chunk in range(self.chunks):
                    _wait_chunk_kernel[(1,)](self.ready.peer_ptrs, source, chunk, self.chunks, epoch,
                                             self.spin_limit, self.errors.word)
                    rows = slice(source * self.rows + self._chunk_rows(chunk).start,
                                 source * self.rows + self._chunk_rows(chunk).stop)
                    mine[rows].copy_(theirs[rows], non_blocking=True)
                    _write_flag(self.ready.local, source * self.chunks + chunk, epoch)

    def pull_published(self, epoch: int) -> None:
        """After `start(..., "pull")` on every rank: on the current stream, one wait for every peer's published shard
        of `epoch`; then per peer, on its side stream, copy-engine pulls chunk by chunk into this rank's buffer, each
        followed by this rank's own flag (source, chunk). A consumer kernel launched next on the current stream polls
        only local flags written after local data by this GPU's own streams. The wait runs on the current stream,
        before the consumer: a spinning kernel on a side stream could be starved of SMs by a persistent consumer."""
        _wait_published_kernel[(self.world,)](self.ready.peer_ptrs, self.rank, self.chunks, epoch, self.spin_limit,
                                              self.errors.word)
        data, _ = self._peers()
        mine = self.gathered(epoch)
        for source in remote_first_order(self.rank, self.world)[:-1]:
            theirs = self.gathered(epoch, data[source])
            with self._side(source):
                for chunk in range(self.chunks):
                    rows = slice(source * self.rows + self._chunk_rows(chunk).start,
                                 source * self.rows + self._chunk_rows(chunk).stop)
                    mine[rows].copy_(theirs[rows], non_blocking=True)
                    _write_flag(self.ready.local, source * self.chunks + chunk, epoch)

    # -- consumer -------------------------------------------------------------------------------------------------
    def finish(self, epoch: int, producer: str) -> torch.Tensor:
        """Enqueue the wait for every chunk of `epoch` (after the pull's copies for producer="pull"); returns the
        gathered [world * rows, cols] view (valid until this object's next call)."""
        if producer == "pull":
            self._pull(epoch)
        wait_ready(self.ready.local, self.ack.peer_ptrs, self.errors.word, self.rank, self.world, epoch,
                   self.chunks, self.spin_limit)
        if self.refusals is not None:  # (none: the owner's own calls say why)
            _refused_sources_kernel[(1,)](self.refusals.local, self.errors.word, self.rank, epoch, WORLD=self.world)
        self.join()
        self.errors.after_wait()
        return self.gathered(epoch)

    def __call__(self, shard: torch.Tensor, producer: str = "device") -> torch.Tensor:
        return self.finish(self.start(shard, producer), producer)
