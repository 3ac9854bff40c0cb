"""Lookup + output dist as one unit: pooled tiles go straight from the owner's kernel into their rank's output.

Forward: one persistent kernel pools the owned tables for the whole global batch and stores every tile into the
destination rank's symmetric output ([local batch, sum of all dims], config column order), its programs split
among the destinations (kernels/peer_tiles.py); a small wait kernel then polls the ready flags of each producer.
Backward: each rank pushes the columns of its output gradient, times the forward's `gradient_scale` (torchrec's
division by the world size, applied on the way), into the owners' symmetric gradient buffers (one remote-first
walk); once its flags are up, the owner accumulates row gradients and applies the embedding
optimizer (the bulk path's code). Transports: p2p (stores through peer pointers) and nvshmem (remote rows put
through NVSHMEM, from a symmetric copy of the gradient in the backward; crosses nodes).

Outputs live in double-buffered symmetric memory (by step parity), whatever the calls' batch sizes (the halves
split the buffer, not one call's rows). A producer of call e waits only for each consumer's ack of call e - 1,
given once that consumer's call e - 1 has its output: so the tensor a call returns stays valid until this rank's
next call, after which a peer running ahead may store its call after next there (clone an output to keep it).
In grad mode the step's own reads (its forward's and backward's, before its gradient goes back) are safe until the
call after next: a peer's call after next comes after its backward of this call, which waits for this rank's
gradient; a backward that would run later raises instead (`check_output_live`). Every rank must call in the same
order (the flags carry per-exchange step counters). After a wait gave up, the call is still acknowledged (its
output is lost, not read), and a producer that gave up waiting for an ack stores nothing and raises no flag: a
peer that was only late finishes its call exactly and the next call is exact (peer_flags).
Each exchange is split into `start` (enqueue the producer kernel) and `finish` (enqueue the wait, return the
result), so a simulated world in one process can start every rank before any waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
from torch import nn

from fused_dlrm.dist.symmetric import (ALLOCATION_TIMEOUT_S, NvshmemSymmetricWorkspace, PeerBuffer, _Workspace,
                                       cuda_workspace)
from fused_dlrm.kernels.peer_flags import DEFAULT_SPIN_LIMIT, PeerErrors, ReadyWait, check_spin_limit, wait_ready
from fused_dlrm.kernels.peer_tiles import PeerTilePlan, default_num_programs, plan_peer_tiles
from fused_dlrm.kernels.pooled_embedding import FeatureTable, PooledEmbeddingLaunch, launch_pooled_embedding_nvshmem
from fused_dlrm.kernels.push_columns import (GradientDestinations, PushColumnsLaunch, is_feature_view,
                                             launch_push_columns_nvshmem)
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup
from fused_dlrm.sparse.plan import FeatureSlice
from fused_dlrm.config_checks import check_count

PUSH_BLOCK_ROWS = 16  # rows per tile of the gradient push (a copy: one remote-first walk, kernels/peer_tiles.py)
WORKSPACES = {"p2p": cuda_workspace, "nvshmem": NvshmemSymmetricWorkspace}  # comm.transport -> its symmetric memory


@dataclass(frozen=True)
class FusedCommConfig:
    transport: str = "p2p"  # p2p: CUDA symmetric memory over NVLink; nvshmem: NVSHMEM puts (crosses nodes)
    num_programs: int | None = None  # persistent programs per launch; None: 32 per SM
    wait_timeout_spins: int = DEFAULT_SPIN_LIMIT  # polls of a flag before a wait gives up and names rank and slice
    allocation_timeout_s: float = ALLOCATION_TIMEOUT_S  # how long a rank waits for its peers at an allocation

    def __post_init__(self):  # before anything is built
        if self.transport not in WORKSPACES:
            raise ValueError(f"comm.transport={self.transport!r} is unknown; expected one of {list(WORKSPACES)}")
        check_spin_limit(self.wait_timeout_spins, "comm.wait_timeout_spins")
        if self.num_programs is not None:  # ranks agree on it as an int64 tensor: a float would be cut, true be 1
            check_count("comm.num_programs", self.num_programs, 1, "a whole number >= 1 or null (32 per SM)")


def build_fused_exchange(lookup: PooledEmbeddingLookup, slices_of_rank: list[list[FeatureSlice]],
                         comm: FusedCommConfig, group: dist.ProcessGroup | None,
                         device: torch.device) -> "FusedPooledAllToAll":
    if device.type != "cuda" or not dist.is_initialized():
        raise RuntimeError("comm=fused needs CUDA GPUs under torchrun (symmetric memory); use comm=bulk on the CPU")
    workspace = WORKSPACES[comm.transport](group, comm.allocation_timeout_s)
    num_programs = agreed_num_programs(comm.num_programs or default_num_programs(device), group, device)
    return FusedPooledAllToAll(lookup, slices_of_rank, workspace, num_programs, comm.wait_timeout_spins)


def agreed_num_programs(requested: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The one program count of every rank: ready flags are laid out by producer rank × program count, so the
    ranks must agree, and the default (per SM) differs between GPU models. The smallest request serves all."""
    count = torch.tensor([requested], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())


@dataclass
class _Plan:
    """What every call with one tuple of local batch sizes shares, built once: the symmetric buffers it points
    into, the pointer tables and this rank's views of both halves of each double buffer (by epoch parity), and
    the p2p launches with their fixed arguments. The host work of a call is then a lookup and a few launches."""
    buffers: tuple[PeerBuffer, ...]  # pooled output, gradient (nvshmem: and the gradient's symmetric source)
    forward_tiles: PeerTilePlan
    push_tiles: PeerTilePlan
    push_row_base: torch.Tensor  # per destination: the first row of my samples in its gradient buffer
    pooled_half: int  # elements per half of the pooled output: half the buffer, whatever this plan's sizes
    grad_half: int  # the same for the gradient buffer
    pooled: tuple[torch.Tensor, torch.Tensor]  # this rank's [local batch, all dims] result, per half
    grad: tuple[torch.Tensor, torch.Tensor]  # this rank's [global batch, owned dims] gradient, per half
    # p2p only:
    pooled_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None  # every rank's half, per half
    grad_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None
    forward: PooledEmbeddingLaunch | None = None
    push: PushColumnsLaunch | None = None


class FusedPooledAllToAll(nn.Module):
    def __init__(self, lookup: PooledEmbeddingLookup, slices_of_rank: list[list[FeatureSlice]],
                 workspace: _Workspace, num_programs: int, spin_limit: int):
        """slices_of_rank[r]: what rank r's lookup pools, in its column order, and where each slice's columns
        belong in the output row (TableShardingPlan.feature_slices; together they cover the row once)."""
        super().__init__()
        self.lookup, self.ws = lookup, workspace
        self.rank, self.world = workspace.rank, workspace.world_size
        if num_programs < self.world:  # the programs are split among the destinations (kernels/peer_tiles.py)
            raise ValueError(f"comm.num_programs={num_programs} is below the world size {self.world}: every "
                             f"destination needs a program")
        self.num_programs, self.spin_limit = num_programs, spin_limit
        mine = slices_of_rank[self.rank]
        if [(s.feature, s.table) for s in mine] != lookup.features:
            raise ValueError(f"rank {self.rank}'s slices {[(s.feature, s.table) for s in mine]} are not its "
                             f"lookup's (feature, table) columns {lookup.features}")
        self.slices_of_rank = slices_of_rank
        every = [s for slices in slices_of_rank for s in slices]  # rank by rank: the push's order
        self.row_len = sum(s.dim for s in every)
        device = workspace.device
        self.owned = FeatureTable([lookup.weights[s.table] for s in mine], [s.col for s in mine],
                                  [lookup.is_mean(s.table) for s in mine], device)
        # Backward: my gradient columns (output order) -> each owner's lookup columns, grouped by owner.
        lookup_cols = [sum(s.dim for s in slices[:i]) for slices in slices_of_rank for i in range(len(slices))]
        self.owned_dim = [sum(s.dim for s in slices) for slices in slices_of_rank]
        as_tensor = lambda xs, dt=torch.int64: torch.tensor(xs or [0], dtype=dt, device=device)
        self.push_src_cols = as_tensor([s.col for s in every])
        self.push_dst_cols = as_tensor(lookup_cols)
        self.push_dims = as_tensor([s.dim for s in every], torch.int32)
        self.push_block_dim = triton.next_power_of_2(max([s.dim for s in every] or [1]))
        self.push_row_len = as_tensor(self.owned_dim)
        # The same mapping per output column (owner, owner's column), for a consumer that pushes the gradient
        # itself (GradientPush): on the host, from which `push_blocks` makes its tables.
        owners = [r for r, slices in enumerate(slices_of_rank) for _ in slices]
        col_dest, col_dst = [0] * self.row_len, [0] * self.row_len
        for s, owner, lookup_col in zip(every, owners, lookup_cols):
            col_dest[s.col:s.col + s.dim] = [owner] * s.dim
            col_dst[s.col:s.col + s.dim] = range(lookup_col, lookup_col + s.dim)
        self._col_map = (torch.tensor(col_dest, dtype=torch.int32), torch.tensor(col_dst, dtype=torch.int32))
        self._push_blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.errors = PeerErrors(device, self.rank, "fused embedding all-to-all")
        self.nvshmem = workspace.transport == "nvshmem"
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._zero_rows = torch.zeros(self.world, dtype=torch.int64, device=device)
        self._waits: dict[str, ReadyWait] = {}
        # Who pushed each backward's gradient: the consumer's kernel (GradientPush taken) or this exchange's push
        # kernel. A silent fallback costs a pass over the gradient; runs report these (bench dlrm_step).
        self.backward_pushes = {"consumer": 0, "exchange": 0}
        self.latest_forward = 0  # the epoch of the last forward started

    def check_output_live(self, epoch: int) -> None:
        """Before a backward reads forward `epoch`'s output: raise if a later forward overwrote it (the call after
        next does; autograd cannot see it, the stores are the peers'). Every rank makes the same calls in the same
        order, so every rank raises here alike."""
        if self.latest_forward >= epoch + 2:
            raise RuntimeError(
                f"fused embedding all-to-all: rank {self.rank}: the backward of forward call {epoch} runs after call "
                f"{self.latest_forward}, and call {epoch + 2} overwrote that call's output (a double buffer), which "
                f"the backward reads: run each forward's backward before the call after next (at most 2 forwards "
                f"in flight, e.g. in gradient accumulation), or use comm=bulk")

    # -- forward ------------------------------------------------------------------------------------------------
    def start(self, bags: OwnedBags) -> int:
        self.errors.check()
        epoch = self.latest_forward = self.ws.next_epoch("pooled")
        plan = self._plan(bags.batch_sizes)
        if self.nvshmem:
            ready, ack = self._flags("pooled")
            scratch = self.ws.buffer("pooled_scratch", self.num_programs * self.owned.block_rows
                                     * self.owned.block_dim, torch.float32)
            half = plan.pooled_half
            launch_pooled_embedding_nvshmem(
                bags.values, bags.csr_offsets(), bags.weights, self.owned, plan.forward_tiles, bags.global_batch,
                out=plan.buffers[0].local[(epoch % 2) * half:][:half], out_row_len=self.row_len,
                scratch=scratch.local, rank=self.rank, epoch=epoch,
                ready=ready.local, ack=ack.local, error=self.errors.word, spin_limit=self.spin_limit)
        else:
            plan.forward(bags.values, bags.csr_offsets(), bags.weights, plan.pooled_ptrs[epoch % 2], epoch)
        return epoch

    def finish(self, bags: OwnedBags, epoch: int) -> torch.Tensor:
        self._wait("pooled", epoch)
        return self._plan(bags.batch_sizes).pooled[epoch % 2]

    # -- backward -----------------------------------------------------------------------------------------------
    def start_backward(self, bags: OwnedBags, grad: torch.Tensor, scale: float = 1.0) -> int:
        """Push grad * scale (grad: [local batch, all dims]) into the owners' gradient buffers."""
        self.errors.check()
        epoch = self.ws.next_epoch("grad")
        plan = self._plan(bags.batch_sizes)
        if self.nvshmem:
            src = plan.buffers[2].local[:grad.numel()].view(grad.shape)
            torch.mul(grad, scale, out=src)  # the puts read symmetric memory (a registered source across nodes)
            ready, ack = self._flags("grad")
            launch_push_columns_nvshmem(
                src, self.push_src_cols, self.push_dst_cols, self.push_dims, self.push_block_dim, plan.push_tiles,
                out=plan.buffers[1].local[(epoch % 2) * plan.grad_half:][:plan.grad_half],
                out_row_base=plan.push_row_base, out_row_len=self.push_row_len, ready=ready.local, ack=ack.local,
                error=self.errors.word, rank=self.rank, epoch=epoch, spin_limit=self.spin_limit,
                block_rows=PUSH_BLOCK_ROWS)
        else:
            plan.push(grad.float().contiguous(), plan.grad_ptrs[epoch % 2], epoch, scale)
        return epoch

    def push_blocks(self, dim: int, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With the output row seen as features of `dim` columns, each feature cut in blocks of `block` columns
        (the last one cut at dim): the owner and the owner's first column of every block, int32 [blocks per
        feature, features] on the device, for a kernel storing the gradient in row blocks (GradientPush); None
        unless every block goes to one owner, contiguously, starting 16 bytes aligned there (every owner's row
        too)."""
        key = (dim, block)
        if key not in self._push_blocks:
            (dest, dst), cols = self._col_map, torch.arange(self.row_len)
            starts = cols % dim % block == 0
            first = torch.nonzero(starts).squeeze(1)[torch.cumsum(starts.long(), 0) - 1]  # each column's block's
            pushable = (self.row_len % dim == 0 and (dest == dest[first]).all() and (dst - dst[first] == cols - first)
                        .all() and (dst[first] % 4 == 0).all() and all(n % 4 == 0 for n in self.owned_dim))
            blocks = torch.arange(0, dim, block)[:, None] + torch.arange(0, self.row_len, dim)[None, :]  # 1st columns
            self._push_blocks[key] = (dest[blocks].to(self.ws.device), dst[blocks].to(self.ws.device)) if pushable \
                else None
        return self._push_blocks[key]

    def gradient_destinations(self, bags: OwnedBags, scale: float, dim: int, block: int) -> GradientDestinations:
        """start_backward for a kernel that stores the gradient itself in row blocks (p2p; `push_blocks(dim,
        block)` must not be None): the epoch's destinations."""
        self.errors.check()
        epoch = self.ws.next_epoch("grad")
        plan = self._plan(bags.batch_sizes)
        ready, ack = self._flags("grad")
        block_dest, block_dst = self.push_blocks(dim, block)
        return GradientDestinations(
            out_ptrs=plan.grad_ptrs[epoch % 2], out_row_base=plan.push_row_base, out_row_len=self.push_row_len,
            block_dest=block_dest, block_dst=block_dst, ready_ptrs=ready.peer_ptrs, ack=ack.local,
            error=self.errors.word, rank=self.rank, epoch=epoch, num_programs=self.num_programs,
            spin_limit=self.spin_limit, scale=scale)

    def finish_backward(self, bags: OwnedBags, epoch: int) -> None:
        self._wait("grad", epoch)
        self.lookup.apply_gradient(bags, self._plan(bags.batch_sizes).grad[epoch % 2])

    def _flags(self, exchange: str):
        """The exchange's ready flags (one per producer program) and acks (one per consumer); 64-bit words with
        nvshmem (its signal type)."""
        dtype = torch.int64 if self.nvshmem else torch.int32
        return (self.ws.buffer(f"{exchange}_ready", self.world * self.num_programs, dtype),
                self.ws.buffer(f"{exchange}_ack", self.world, dtype))

    def _wait(self, exchange: str, epoch: int) -> None:
        """Enqueue the wait for every producer's flags of `exchange`'s `epoch`; its result is ready after it."""
        ready, ack = self._flags(exchange)
        if self.nvshmem:
            wait_ready(ready.local, ack.local, self.errors.word, self.rank, self.world, epoch, self.num_programs,
                       self.spin_limit, nvshmem=True)
        else:
            wait = self._waits.get(exchange)
            if wait is None:  # flags never grow (they carry epochs): one wait per exchange
                wait = self._waits[exchange] = ReadyWait(ready.local, ack.peer_ptrs, self.errors.word, self.rank,
                                                         self.world, self.num_programs, self.spin_limit)
            wait(epoch)
        self.errors.after_wait()

    def forward(self, bags: OwnedBags, gradient_scale: float = 1.0) -> torch.Tensor:
        """[local batch, all dims] pooled; in grad mode (train or eval, as the lookup), its gradient times
        `gradient_scale` reaches the owners."""
        if torch.is_grad_enabled():
            return _FusedExchange.apply(self.lookup._anchor, self, bags, gradient_scale)
        return self.finish(bags, self.start(bags))

    def _plan(self, batch_sizes: list[int]) -> _Plan:
        sizes = tuple(batch_sizes)
        plan = self._plans.get(sizes)
        return plan if plan is not None else self._new_plan(sizes)

    def _new_plan(self, sizes: tuple[int, ...]) -> _Plan:
        """Built on the first call with these sizes, in the same order on every rank (allocation is collective)."""
        batch_start = [sum(sizes[:r]) for r in range(self.world + 1)]
        global_batch, device = batch_start[-1], self.ws.device
        pooled_rows = max(sizes) * self.row_len  # elements: my largest [local batch, all dims]
        pooled = self.ws.buffer("pooled", 2 * pooled_rows, torch.float32)
        pooled_ready, pooled_ack = self._flags("pooled")
        grad = self.ws.buffer("grad", 2 * global_batch * max(self.owned_dim + [1]), torch.float32)
        # The halves split each buffer as it is (never shrunk), not by these sizes: plans of other sizes share
        # it, and a step's half must never overlap the previous step's (the producers' guard only keeps them
        # off the half of the step before that), whichever plans the two steps used.
        pooled_half, grad_half = pooled.local.numel() // 2, grad.local.numel() // 2
        buffers = (pooled, grad)
        if self.nvshmem:  # every rank asks for the same sizes: NVSHMEM allocations are collective
            buffers += (self.ws.buffer("grad_source", pooled_rows, torch.float32),)
        # Plans made before a buffer grew point into the old one (and split it by its size): drop them (their
        # sizes plan anew). The outputs they returned stay in the old memory, which nobody writes any more.
        self._plans = {k: p for k, p in self._plans.items() if all(a is b for a, b in zip(p.buffers, buffers))}
        forward_tiles = plan_peer_tiles(self.rank, [(batch_start[s], batch_start[s + 1]) for s in range(self.world)],
                                        [(0, len(self.slices_of_rank[self.rank]))] * self.world,
                                        self.owned.block_rows, self.num_programs, device)
        first = [sum(len(f) for f in self.slices_of_rank[:r]) for r in range(self.world)]
        push_tiles = plan_peer_tiles(self.rank, [(0, sizes[self.rank])] * self.world,
                                     [(first[r], len(self.slices_of_rank[r])) for r in range(self.world)],
                                     PUSH_BLOCK_ROWS, self.num_programs, device, local_tile_cost=None)
        my_rows = torch.full((self.world,), batch_start[self.rank], dtype=torch.int64, device=device)
        plan = _Plan(buffers=buffers, forward_tiles=forward_tiles, push_tiles=push_tiles, push_row_base=my_rows,
                     pooled_half=pooled_half, grad_half=grad_half,
                     pooled=_halves(pooled.local, pooled_half, sizes[self.rank], self.row_len),
                     grad=_halves(grad.local, grad_half, global_batch, self.owned_dim[self.rank]))
        if not self.nvshmem:
            grad_ready, grad_ack = self._flags("grad")
            plan.pooled_ptrs = _half_ptrs(pooled, pooled_half)
            plan.grad_ptrs = _half_ptrs(grad, grad_half)
            common = dict(error=self.errors.word, rank=self.rank, spin_limit=self.spin_limit)
            plan.forward = PooledEmbeddingLaunch(self.owned, forward_tiles, global_batch, self._zero_rows,
                                                 self.row_len, ready_ptrs=pooled_ready.peer_ptrs,
                                                 ack=pooled_ack.local, **common)
            plan.push = PushColumnsLaunch(self.row_len, self.push_src_cols, self.push_dst_cols, self.push_dims,
                                          self.push_block_dim, push_tiles, my_rows, self.push_row_len,
                                          grad_ready.peer_ptrs, grad_ack.local, block_rows=PUSH_BLOCK_ROWS,
                                          **common)
        self._plans[sizes] = plan
        return plan


def _halves(local: torch.Tensor, half: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [rows, cols] views at the start of both halves of a double buffer."""
    return tuple(local[h * half:h * half + rows * cols].view(rows, cols) for h in range(2))


def _half_ptrs(buffer: PeerBuffer, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer-pointer tables of both halves of a double buffer."""
    return tuple(buffer.peer_ptrs + h * half * buffer.local.element_size() for h in range(2))


class GradientPush:
    """The exchange's backward push, offered to the consumer of its output (DLRM's pairwise interaction,
    kernels/pairwise_interaction.py: `offered_gradient_push` finds it on this exchange's autograd node): a
    consumer whose backward kernel makes the output's gradient stores it into the owners' buffers itself
    (`begin`: the epoch's destinations; its kernel raises the flags), and the exchange's backward then only waits
    for the flags and applies the rows' gradients. p2p transport only."""

    def __init__(self, exchange: FusedPooledAllToAll, bags: OwnedBags, scale: float, output: torch.Tensor,
                 forward_epoch: int):
        self.exchange, self.bags, self.scale, self.output = exchange, bags, scale, output
        self.forward_epoch = forward_epoch  # the output's
        self.epoch: int | None = None  # of the push, once begun

    def serves(self, x: torch.Tensor, block: int) -> bool:
        """x is the output seen as [batch, F, D] (row-major features), and a kernel storing the gradient of x in
        blocks of `block` columns per feature finds each block one owner's contiguous, aligned columns."""
        out = self.output  # (a buffer half: its reuse two steps on replaces its node, ending the node's cycle)
        return (is_feature_view(x, out.data_ptr(), tuple(out.shape), out.stride(0))
                and self.exchange.push_blocks(x.shape[2], block) is not None)

    def begin(self, dim: int, block: int) -> GradientDestinations:
        """The destinations of this forward's gradient, stored by a kernel in blocks of `block` of a feature's
        `dim` columns (`serves` said yes)."""
        if self.epoch is not None:
            raise RuntimeError("the fused embedding exchange's gradient push was begun twice for one forward")
        self.exchange.check_output_live(self.forward_epoch)  # before the consumer's kernel reads the output
        destinations = self.exchange.gradient_destinations(self.bags, self.scale, dim, block)
        self.epoch = destinations.epoch
        return destinations


class _FusedExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, exchange: FusedPooledAllToAll, bags: OwnedBags, gradient_scale: float):
        ctx.exchange, ctx.bags, ctx.scale = exchange, bags, gradient_scale
        ctx.set_materialize_grads(False)  # None: the consumer pushed the gradient itself
        ctx.epoch = exchange.start(bags)
        out = exchange.finish(bags, ctx.epoch)
        ctx.gradient_push = None if exchange.nvshmem else GradientPush(exchange, bags, gradient_scale, out, ctx.epoch)
        return out

    @staticmethod
    def backward(ctx, grad):
        ex, push = ctx.exchange, ctx.gradient_push
        if push is not None and push.epoch is not None:
            if grad is not None:  # the push stored (not added) its gradient: another one cannot join it
                raise RuntimeError("the fused embedding exchange's output has a consumer besides the one that "
                                   "pushed its gradient to the owners (the pairwise interaction): their gradients "
                                   "cannot be summed; use comm=bulk for such a model")
            epoch = push.epoch
            ex.backward_pushes["consumer"] += 1
        else:
            ex.check_output_live(ctx.epoch)  # the consumers' backward may have read it: no update from theirs
            grad = torch.zeros(ctx.bags.batch_sizes[ex.rank], ex.row_len, device=ex.ws.device) if grad is None \
                else grad
            epoch = ex.start_backward(ctx.bags, grad, ctx.scale)
            ex.backward_pushes["exchange"] += 1
        ex.finish_backward(ctx.bags, epoch)
        return None, None, None, None
