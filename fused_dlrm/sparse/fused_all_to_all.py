"""Lookup + output dist as one unit: pooled tiles go straight from the owner's kernel into their rank's output.

Forward: one persistent kernel pools the owned tables for the whole global batch and stores every tile into the
destination rank's symmetric output ([local batch, sum of all dims], config column order), remote ranks first;
a small wait kernel then polls the ready flags of each producer. Backward: each rank pushes the columns of its
output gradient into the owners' symmetric gradient buffers the same way; once its flags are up, the owner
accumulates row gradients and applies the embedding optimizer (the bulk path's code).

Outputs live in double-buffered symmetric memory (by step parity): the tensor a step returns stays valid until
the call after next. Every rank must call in the same order (the flags carry per-exchange step counters).
Each exchange is split into `start` (enqueue the producer kernel) and `finish` (enqueue the wait, return the
result), so a simulated world in one process can start every rank before any waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import triton
from torch import nn
from torchrec import EmbeddingBagConfig

from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace, NvshmemSymmetricWorkspace, _Workspace
from fused_dlrm.kernels.peer_flags import PeerErrors, wait_ready
from fused_dlrm.kernels.peer_tiles import default_num_programs, plan_peer_tiles
from fused_dlrm.kernels.pooled_embedding import FeatureTable, launch_pooled_embedding, launch_pooled_embedding_nvshmem
from fused_dlrm.kernels.push_columns import launch_push_columns
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup

PUSH_BLOCK_ROWS = 16  # rows per tile of the gradient push
NVSHMEM_FORWARD_ONLY = (
    "comm.transport=nvshmem runs the forward only (evaluation, inference): its gradient push gave wrong embedding "
    "updates on 2 x H200 (2026-11-22) and was removed; train with comm.transport=p2p or comm=bulk")


@dataclass(frozen=True)
class FusedCommConfig:
    transport: str = "p2p"  # p2p: CUDA symmetric memory over NVLink; nvshmem: NVSHMEM puts (crosses nodes)
    num_programs: int | None = None  # persistent programs per launch; None: 32 per SM
    wait_timeout_spins: int = 20_000_000  # polls of a flag before a wait gives up and reports rank and slice


def build_fused_exchange(lookup: PooledEmbeddingLookup, features_of_rank: list[list[str]],
                         tables: list[EmbeddingBagConfig], comm: FusedCommConfig,
                         group: dist.ProcessGroup | None, device: torch.device) -> "FusedPooledAllToAll":
    workspaces = {"p2p": CudaSymmetricWorkspace, "nvshmem": NvshmemSymmetricWorkspace}
    if comm.transport not in workspaces:
        raise ValueError(f"comm.transport={comm.transport!r} is unknown; expected one of {list(workspaces)}")
    if device.type != "cuda" or not dist.is_initialized():
        raise RuntimeError("comm=fused needs CUDA GPUs under torchrun (symmetric memory); use comm=bulk on the CPU")
    workspace = workspaces[comm.transport](group)
    dims = {f: t.embedding_dim for t in tables for f in t.feature_names}
    order = [f for t in tables for f in t.feature_names]
    return FusedPooledAllToAll(lookup, features_of_rank, dims, order, workspace,
                               comm.num_programs or default_num_programs(device), comm.wait_timeout_spins)


class FusedPooledAllToAll(nn.Module):
    def __init__(self, lookup: PooledEmbeddingLookup, features_of_rank: list[list[str]],
                 dims: dict[str, int], feature_order: list[str], workspace: _Workspace,
                 num_programs: int, spin_limit: int):
        """features_of_rank[r]: features rank r owns, in its lookup's column order; feature_order: the output's."""
        super().__init__()
        self.lookup, self.ws = lookup, workspace
        self.rank, self.world = workspace.rank, workspace.world_size
        self.num_programs, self.spin_limit = num_programs, spin_limit
        self.features_of_rank = features_of_rank
        self.dims = [dims[f] for f in feature_order]
        self.row_len = sum(self.dims)
        config_col = dict(zip(feature_order, [sum(self.dims[:i]) for i in range(len(self.dims))]))
        device = workspace.device
        mine = features_of_rank[self.rank]
        self.owned = FeatureTable([lookup.weights[t] for _, t in lookup.features], [config_col[f] for f in mine],
                                  [lookup.is_mean(t) for _, t in lookup.features], device)
        # Backward: my gradient columns (config order) -> each owner's lookup columns, grouped by owner.
        pushed = [(f, r) for r in range(self.world) for f in features_of_rank[r]]
        lookup_col = {f: sum(dims[g] for g in feats[:i]) for feats in features_of_rank for i, f in enumerate(feats)}
        self.owned_dim = [sum(dims[f] for f in feats) for feats in features_of_rank]
        as_tensor = lambda xs, dt=torch.int64: torch.tensor(xs or [0], dtype=dt, device=device)
        self.push_src_cols = as_tensor([config_col[f] for f, _ in pushed])
        self.push_dst_cols = as_tensor([lookup_col[f] for f, _ in pushed])
        self.push_dims = as_tensor([dims[f] for f, _ in pushed], torch.int32)
        self.push_block_dim = triton.next_power_of_2(max(self.dims or [1]))
        self.push_row_len = as_tensor(self.owned_dim)
        self.errors = PeerErrors(device, self.rank, "fused embedding all-to-all")
        self.nvshmem = workspace.transport == "nvshmem"
        self._plans = lru_cache(maxsize=8)(self._plans_for)
        self._zero_rows = torch.zeros(self.world, dtype=torch.int64, device=device)

    # -- forward ------------------------------------------------------------------------------------------------
    def start(self, bags: OwnedBags) -> int:
        self.errors.check()
        epoch = self.ws.next_epoch("pooled")
        sizes = tuple(bags.batch_sizes)
        forward_plan, _, _ = self._plans(sizes)
        half = max(sizes) * self.row_len
        out = self.ws.buffer("pooled", 2 * half, torch.float32)
        ready, ack = self._flags("pooled")
        common = dict(values=bags.values, offsets=bags.csr_offsets(), weights=bags.weights, features=self.owned,
                      plan=forward_plan, global_batch=bags.global_batch, out_row_len=self.row_len,
                      num_programs=self.num_programs, rank=self.rank, epoch=epoch, error=self.errors.word,
                      spin_limit=self.spin_limit)
        if self.nvshmem:
            scratch = self.ws.buffer("pooled_scratch", self.num_programs * self.owned.block_rows
                                     * self.owned.block_dim, torch.float32)
            launch_pooled_embedding_nvshmem(out=_local_half(out, epoch, half), scratch=scratch.local,
                                            ready=ready.local, ack=ack.local, **common)
        else:
            launch_pooled_embedding(out_ptrs=_half(out, epoch, half), out_row_base=self._zero_rows,
                                    ready_ptrs=ready.peer_ptrs, ack=ack.local, **common)
        return epoch

    def finish(self, bags: OwnedBags, epoch: int) -> torch.Tensor:
        sizes = bags.batch_sizes
        return self._wait("pooled", epoch, max(sizes) * self.row_len, sizes[self.rank], self.row_len)

    # -- backward -----------------------------------------------------------------------------------------------
    def start_backward(self, bags: OwnedBags, grad: torch.Tensor) -> int:
        if self.nvshmem:
            raise RuntimeError(NVSHMEM_FORWARD_ONLY)
        self.errors.check()
        epoch = self.ws.next_epoch("grad")
        sizes = tuple(bags.batch_sizes)
        _, push_plan, batch_start = self._plans(sizes)
        half = bags.global_batch * max(self.owned_dim + [1])
        out = self.ws.buffer("grad", 2 * half, torch.float32)
        ready, ack = self._flags("grad")
        my_rows = torch.full((self.world,), batch_start[self.rank], dtype=torch.int64, device=grad.device)
        columns = (self.push_src_cols, self.push_dst_cols, self.push_dims, self.push_block_dim, push_plan)
        launch_push_columns(grad.float().contiguous(), *columns, _half(out, epoch, half), my_rows,
                            self.push_row_len, ready.peer_ptrs, ack.local, self.errors.word, self.rank, epoch,
                            self.num_programs, self.spin_limit, PUSH_BLOCK_ROWS)
        return epoch

    def finish_backward(self, bags: OwnedBags, epoch: int) -> None:
        half = bags.global_batch * max(self.owned_dim + [1])
        grad = self._wait("grad", epoch, half, bags.global_batch, self.owned_dim[self.rank])
        self.lookup.apply_gradient(bags, grad)

    def _flags(self, exchange: str):
        """The exchange's ready flags (one per producer program) and acks (one per consumer); 64-bit words with
        nvshmem (its signal type)."""
        dtype = torch.int64 if self.nvshmem else torch.int32
        return (self.ws.buffer(f"{exchange}_ready", self.world * self.num_programs, dtype),
                self.ws.buffer(f"{exchange}_ack", self.world, dtype))

    def _wait(self, exchange: str, epoch: int, half: int, rows: int, cols: int) -> torch.Tensor:
        """Enqueue the wait for every producer's flags of `epoch`; then `exchange`'s [rows, cols] result is ready."""
        ready, ack = self._flags(exchange)
        wait_ready(ready.local, ack.local if self.nvshmem else ack.peer_ptrs, self.errors.word, self.rank,
                   self.world, epoch, self.num_programs, self.spin_limit, nvshmem=self.nvshmem)
        self.errors.after_wait()
        base = (epoch % 2) * half
        return self.ws.buffer(exchange, 2 * half, torch.float32).local[base:base + rows * cols].view(rows, cols)

    def forward(self, bags: OwnedBags) -> torch.Tensor:
        if self.lookup.training and torch.is_grad_enabled():
            return _FusedExchange.apply(self.lookup._anchor, self, bags)
        return self.finish(bags, self.start(bags))

    def _plans_for(self, sizes: tuple[int, ...]):
        batch_start = [sum(sizes[:r]) for r in range(self.world + 1)]
        n_mine = len(self.features_of_rank[self.rank])
        forward = plan_peer_tiles(self.rank, [(batch_start[s], batch_start[s + 1]) for s in range(self.world)],
                                  [(0, n_mine)] * self.world, self.owned.block_rows, self.ws.device)
        first = [sum(len(f) for f in self.features_of_rank[:r]) for r in range(self.world)]
        push = plan_peer_tiles(self.rank, [(0, sizes[self.rank])] * self.world,
                               [(first[r], len(self.features_of_rank[r])) for r in range(self.world)],
                               PUSH_BLOCK_ROWS, self.ws.device)
        return forward, push, batch_start


def _half(buffer, epoch: int, half_numel: int) -> torch.Tensor:
    """Peer addresses of the half of a double buffer that `epoch` uses."""
    return buffer.peer_ptrs + (epoch % 2) * half_numel * buffer.local.element_size()


def _local_half(buffer, epoch: int, half_numel: int) -> torch.Tensor:
    """This rank's half of a double buffer that `epoch` uses (nvshmem addresses it in every PE)."""
    return buffer.local[(epoch % 2) * half_numel:][:half_numel]


class _FusedExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, exchange: FusedPooledAllToAll, bags: OwnedBags):
        ctx.exchange, ctx.bags = exchange, bags
        return exchange.finish(bags, exchange.start(bags))

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.exchange
        ex.finish_backward(ctx.bags, ex.start_backward(ctx.bags, grad))
        return None, None, None
