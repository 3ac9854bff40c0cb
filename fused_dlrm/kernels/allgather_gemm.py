"""AllGather + GEMM (column-parallel linear): out = all_gather(x_shard) @ weight, the GEMM consuming chunks as
they arrive.

    all_gather_matmul(x_shard [rows, K], weight [K, N], workspace, producer="copy_engine" | "device", *,
                      return_gathered=False, out=None, config=None) -> out [world * rows, N]
                      (or (out, gathered [world * rows, K]) with return_gathered=True)

The consumer is one persistent Triton GEMM (fp16/bf16 in, fp32 accumulate). Its M-tiles never straddle two
source ranks; a tile of source s waits (bounded) only for the flag of the chunk of s it reads. Sources are taken
in the order rank, rank - 1, rank - 2, ...: the local shard first (read in place from x_shard, no wait), then the
peer whose push to us comes first (every rank pushes to rank + 1 first, `allgather.py`). The shards travel
through `SymmetricAllGather`'s buffers and flags:
- producer="copy_engine": copies on one side stream per peer with a stream-written flag after each chunk;
- producer="device": the GEMM's own programs first push their share of chunks to the peers, then compute. One
  launch, not a push kernel on another stream: two kernels whose programs wait on each other deadlock when the
  consumer's persistent programs take every SM before the producer's are scheduled; inside one launch whose grid
  is at most one program per SM, every program is resident. (The interpreter runs a launch's programs one after
  another, so in the simulated world the same kernel runs twice: push only for every rank, then compute.)
The last program to finish acknowledges the epoch to every peer (a never-reset launch counter reaching
epoch * programs): the guard that lets peers overwrite the other half of the double buffer next time.
With return_gathered=True the tiles of the first N-block also store the A blocks they read (the column-parallel
backward needs the gathered input). `all_gather_matmul_bulk` is the bulk twin (all_gather_into_tensor + matmul);
`all_gather_matmul_reference` the pure-torch definition.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import _Workspace
from fused_dlrm.kernels.allgather import SymmetricAllGather, push_chunk, wait_chunk
from fused_dlrm.kernels.peer_flags import signal_ready

GEMM_PRODUCERS = ("copy_engine", "device")


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
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # M-blocks walked together per N sweep (L2 reuse of the weight)
    chunk_rows: int = 256  # rows per flag (a multiple of block_m): small enough to spread the device push
    # over many programs (a pushing program computes its tiles late) and to start remote tiles early
    num_warps: int = 8
    num_stages: int = 3
    num_programs: int | None = None  # persistent programs; None: one per SM (all co-resident)
    spin_limit: int = 20_000_000


@triton.jit(do_not_specialize=["epoch"])  # one compiled variant for every epoch
def _all_gather_matmul_kernel(
    x_ptr, w_ptr, out_ptr, gathered_ptr, data_ptr, data_ptrs, ready_ptr, ready_ptrs, ack_ptr, ack_ptrs,
    counter_ptr, error_ptr, rows, K, N, stride_wk, stride_wn, rank, epoch, chunk_rows, chunks, half_offset,
    num_programs, spin_limit,
    WORLD: tl.constexpr, PUSH: tl.constexpr, COMPUTE: tl.constexpr, STORE_GATHERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    GROUP_M: tl.constexpr, PUSH_R: tl.constexpr, PUSH_C: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    if PUSH:  # my share of (peer, chunk) pushes, nearest peer first; no local slot: tiles read x_shard in place
        i = num_programs - 1 - pid  # the last programs push: they get one tile fewer when tiles do not divide evenly
        while i < (WORLD - 1) * chunks:
            push_chunk(x_ptr, data_ptrs, ready_ptrs, ack_ptr, error_ptr, (rank + 1 + i // chunks) % WORLD,
                       i % chunks, rank, epoch, rows, K, chunk_rows, chunks, half_offset, spin_limit, PUSH_R, PUSH_C)
            i += num_programs
    if COMPUTE:
        m_blocks = tl.cdiv(rows, BLOCK_M)
        n_blocks = tl.cdiv(N, BLOCK_N)
        per_source = m_blocks * n_blocks
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        t = pid
        while t < WORLD * per_source:
            source = (rank + WORLD - t // per_source) % WORLD  # local first, then the peer that pushes to us first
            u = t % per_source
            group_first = (u // (GROUP_M * n_blocks)) * GROUP_M
            group_size = tl.minimum(m_blocks - group_first, GROUP_M)
            mb = group_first + (u % (GROUP_M * n_blocks)) % group_size
            nb = (u % (GROUP_M * n_blocks)) // group_size
            rm = mb * BLOCK_M + offs_m
            rn = nb * BLOCK_N + offs_n
            if source == rank:
                a_base = x_ptr
            else:
                wait_chunk(ready_ptr, source, (mb * BLOCK_M) // chunk_rows, chunks, epoch, spin_limit, error_ptr)
                a_base = data_ptr + half_offset + source.to(tl.int64) * rows * K
            a_ptrs = a_base + rm.to(tl.int64)[:, None] * K + offs_k[None, :]
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
            g_ptrs = gathered_ptr + (source.to(tl.int64) * rows + rm)[:, None] * K + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(K_TILES):  # a constexpr trip count: compiled loops over it are software-pipelined
                k = kt * BLOCK_K
                a_mask = (rm < rows)[:, None] & (offs_k + k < K)[None, :]
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                w = tl.load(w_ptrs, mask=(offs_k + k < K)[:, None] & (rn < N)[None, :], other=0.0)
                if DOT_FP32:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
                    acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
                else:
                    acc = tl.dot(a, w, acc)
                if STORE_GATHERED:
                    tl.store(g_ptrs, a, mask=a_mask & (nb == 0))
                    g_ptrs += BLOCK_K
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_wk
            out = out_ptr + (source.to(tl.int64) * rows + rm)[:, None] * N + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < rows)[:, None] & (rn < N)[None, :])
            t += num_programs
        # The last program done acknowledges the epoch to every rank: all reads of the buffer half are over.
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
        if done == tl.cast(epoch, tl.int64) * num_programs:
            signal_ready(ack_ptrs, rank, epoch, WORLD)


class AllGatherMatmul:
    """The fused op for one shape class (rows per rank, K, dtype) on one workspace; see the module docstring."""

    def __init__(self, workspace: _Workspace, rows: int, k: int, dtype: torch.dtype, config: GemmConfig):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"all_gather_matmul: dtype {dtype} (expected fp16 or bf16)")
        self.config = config
        chunk_rows = max(config.block_m, config.chunk_rows // config.block_m * config.block_m)
        self.gather = SymmetricAllGather(workspace, rows, k, dtype, chunk_rows, name="allgather_matmul",
                                         spin_limit=config.spin_limit)
        self.rank, self.world = workspace.rank, workspace.world_size
        self.rows, self.k = rows, k
        self.fused_push = workspace.device.type == "cuda"  # False: the interpreter (see the module docstring)
        self.num_programs = config.num_programs or self.gather.num_programs
        self.counter = torch.zeros(1, dtype=torch.int64, device=workspace.device)  # programs done, never reset

    def start(self, x_shard: torch.Tensor, producer: str) -> int:
        """Enqueue the producer side; returns the epoch (on GPUs the device push runs inside `finish`'s launch)."""
        if producer not in GEMM_PRODUCERS:
            raise ValueError(f"unknown producer {producer!r}: expected one of {GEMM_PRODUCERS}")
        if producer == "copy_engine":
            return self.gather.start(x_shard, producer, include_local=False)
        self.gather.errors.check()
        epoch = self.gather.next_epoch()
        if not self.fused_push:
            self._launch(x_shard.contiguous(), None, None, None, epoch, push=True, compute=False)
        return epoch

    def finish(self, epoch: int, x_shard: torch.Tensor, weight: torch.Tensor, producer: str,
               return_gathered: bool = False, out: torch.Tensor | None = None):
        x_shard = x_shard.contiguous()
        if weight.shape[0] != self.k or weight.dtype != x_shard.dtype:
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype}: expected ({self.k}, N) {x_shard.dtype}")
        m = self.world * self.rows
        out = torch.empty((m, weight.shape[1]), dtype=x_shard.dtype, device=x_shard.device) if out is None else out
        gathered = torch.empty((m, self.k), dtype=x_shard.dtype, device=x_shard.device) if return_gathered else None
        self._launch(x_shard, weight, out, gathered, epoch, push=producer == "device" and self.fused_push,
                     compute=True)
        self.gather.join()
        self.gather.errors.after_wait(epoch)
        return (out, gathered) if return_gathered else out

    def _launch(self, x, weight, out, gathered, epoch, push: bool, compute: bool) -> None:
        g, c = self.gather, self.config
        n = weight.shape[1] if compute else 0
        _all_gather_matmul_kernel[(self.num_programs,)](
            x, x if weight is None else weight, x if out is None else out, x if gathered is None else gathered,
            g.data.local, g.data.peer_ptrs, g.ready.local, g.ready.peer_ptrs, g.ack.local, g.ack.peer_ptrs,
            self.counter, g.errors.word, self.rows, self.k, n,
            0 if weight is None else weight.stride(0), 0 if weight is None else weight.stride(1),
            self.rank, epoch, g.chunk_rows, g.chunks, g.half_offset(epoch), self.num_programs, c.spin_limit,
            WORLD=self.world, PUSH=push, COMPUTE=compute, STORE_GATHERED=gathered is not None,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, K_TILES=triton.cdiv(self.k, c.block_k),
            GROUP_M=c.group_m, PUSH_R=g.block_rows, PUSH_C=g.block_cols, DOT_FP32=not self.fused_push,
            num_warps=c.num_warps, num_stages=c.num_stages)


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
                      producer: str = "copy_engine", *, return_gathered: bool = False,
                      out: torch.Tensor | None = None, config: GemmConfig | None = None):
    """all_gather(x_shard) @ weight over the workspace's group; x_shard [rows, K] (same rows on every rank),
    weight [K, N] (any strides, e.g. a Linear's weight.t()). Every rank calls with the same shapes and producer."""
    op = op_for(workspace, x_shard, config)
    return op.finish(op.start(x_shard, producer), x_shard, weight, producer, return_gathered, out)
