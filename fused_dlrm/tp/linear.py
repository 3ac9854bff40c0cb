"""Tensor-parallel linears (Megatron-style) over a TP process group, bulk or fused communication.

ColumnParallelLinear: y[..., out / tp] = x @ W_r^T, rank r holding rows r of W [out, in] (output features split).
Its input is either replicated (the whole x on every rank; backward all-reduces the input gradient: Megatron's
"f") or sequence-sharded (rows of x split over ranks, all-gathered before the matmul; backward reduce-scatters).
RowParallelLinear: y[..., out] = sum_r x_r @ W_r^T, rank r holding columns r of W (input features split); the
all-reduce of the output is Megatron's "g" (backward: the gradient is already replicated, nothing to do), or with
a sequence-sharded output (sequence parallelism) a reduce-scatter over dim 0 (backward all-gathers the gradient).

comm="bulk": torch.distributed collectives inside autograd functions (gloo on the CPU, NCCL on GPUs).
comm="fused" (CUDA only; fp16/bf16 inputs, or fp32 ones under CUDA autocast to fp16/bf16, which are cast as
autocast casts a linear's operands; fp32 without autocast takes the bulk twin): RowParallelLinear computes
x @ W_r^T and the all-reduce in one launch (kernels.gemm_allreduce: any number of rows, from decode's one to a
training step's tokens); a sequence-sharded ColumnParallelLinear runs the all-gather + GEMM (kernels.allgather_gemm,
device push).
A replicated-input ColumnParallelLinear has no forward communication to fuse; its backward's all-reduce of the
input gradient is, with the matmul that makes it (grad @ W_r, the same kernel); the sequence-sharded one's
backward reduce-scatters the input gradient in that kernel's reduce-scatter form. A RowParallelLinear with a
sequence-sharded output runs GEMM + reduce-scatter forward, and all-gather + GEMM for its input gradient backward;
that all-gather + GEMM reads through TMA (out_features and in_features / tp multiples of 8), which its forward
checks before the exchange starts (`check_gradient_gather`).

Initialisation is a function of (seed, std) only: every rank draws the full [out, in] weight from one generator
and keeps its shard, so a TP-sharded model equals the unsharded one (tp = 1). The shard is registered as
`shard_<r>_of_<tp>`: torch.distributed.checkpoint then keeps every shard as its own entry instead of taking them
for one replicated tensor. Bias-free (the Transformer's projections have none).

Every rank of the group must call a layer with x of one shape and dtype (and the same autocast). On gloo, whose
collectives abort the process on messages of other sizes or dtypes, and where a rank whose matmul refuses its x
would raise alone, the ranks compare their calls first (dist.env.check_same_call: one small all-gather per call), so
a mismatch raises CallMismatch (a ValueError) on every rank. Not on NCCL (a collective more per call): there the
fused kernels compare their peers' calls on the device (a signature beside their flags: PeerCallMismatch, a
CallMismatch, on every rank, on GPUs at a later call or `errors.check(block=True)`; an x whose features the GEMM +
all-reduce of one rank refuses raises its ValueError there and PeerRefusedInput on the others), while a bulk call of
other shapes waits or sums them. An empty batch (x of 0 rows on every rank) is a call like any other, forward and
backward: empty outputs and input gradients, zero weight gradients; on one rank only, it is a call unlike its peers'.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fused_dlrm.dist.env import check_same_call
from fused_dlrm.dist.symmetric import ALLOCATION_TIMEOUT_S, cuda_workspace
from fused_dlrm.kernels import dtype_code, dtype_name
from fused_dlrm.kernels.allgather_gemm import all_gather_matmul, check_weight
from fused_dlrm.kernels.gemm_allreduce import GemmAllReduce
from fused_dlrm.kernels.tma import require_tma_readable
from fused_dlrm.config_checks import check_count

COMMS = ("bulk", "fused")
LOW_PRECISION = (torch.float16, torch.bfloat16)  # what the fused kernels compute in
SIGNATURE_DIMS = 6  # x's dims a call's signature lists (its dim count and numel tell any other shape apart too)


def check_tp_size(tp_size: object, world: int, key: str = "tp_size") -> None:
    """Raise `<key>=<tp_size>: expected ...` unless tp_size is a whole number >= 1 dividing the world size: a host
    check of the config alone, the same on every rank, so callers run it before any collective (moe/train.py's
    build_model, before the checks that divide by it)."""
    expected = f"a whole number >= 1 dividing the world size {world}"
    check_count(key, tp_size, 1, expected)
    if world % tp_size:
        raise ValueError(f"{key}={tp_size!r}: expected {expected}")


def tp_groups(tp_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(TP group, data-parallel group) of this rank: TP groups of `tp_size` consecutive ranks, DP groups of the
    ranks with the same position in their TP group (a collective call when tp_size > 1). tp_size 1 gives
    (None, None): no TP communication, the data-parallel group is the whole world."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_tp_size(tp_size, world)
    if tp_size == 1:
        return None, None
    rank = dist.get_rank()
    mine = {}
    for first in range(0, world, tp_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + tp_size)))
        if rank // tp_size == first // tp_size:
            mine["tp"] = group
    for position in range(tp_size):
        group = dist.new_group(list(range(position, world, tp_size)))
        if rank % tp_size == position:
            mine["dp"] = group
    return mine["tp"], mine["dp"]


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:  # torch's -1 for a group this rank is not in: an empty shard, collectives that do nothing
        raise ValueError(f"rank {dist.get_rank()} is not in the group the layer is given: pass its own TP group "
                         "(tp_groups)")
    return dist.get_world_size(group), rank


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (x replicated over the group); backward: all-reduce of the input gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce of the partial outputs; backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, y, group):
        dist.all_reduce(y, group=group)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _reduce_scatter_rows(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, _ = _size_rank(group)
    out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather of the ranks' rows (dim 0); backward: reduce-scatter of the gradient's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, _ = _size_rank(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: reduce-scatter of the partial outputs' rows (dim 0); backward: all-gather of the gradient's rows."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _reduce_scatter_rows(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherRows.apply(grad, ctx.group), None


class _FusedGatherMatmul(torch.autograd.Function):
    """Forward: all-gather of x's rows and x @ W^T as one fused op (it also returns the gathered rows, which the
    weight gradient needs); backward: the gathered input's gradient grad @ W reduce-scattered over rows in one
    launch (the GEMM + all-reduce kernel's reduce-scatter form)."""

    @staticmethod
    def forward(ctx, x2d, weight, group, allocation_timeout_s):
        out, gathered = all_gather_matmul(x2d, weight.t(), _workspace(group, allocation_timeout_s),
                                          return_gathered=True)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.allocation_timeout_s = group, allocation_timeout_s
        return out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad = grad.contiguous()
        # the op's output is reused by the call after next
        grad_x = _fused_all_reduce(ctx.group, ctx.allocation_timeout_s).reduce_scatter(grad, weight).clone()
        return grad_x, grad.t() @ gathered, None, None


class _FusedRowParallelScatter(torch.autograd.Function):
    """Forward: x @ W^T and the reduce-scatter of its rows in one launch; backward: the gradient's rows
    all-gathered and multiplied by W in one fused op (all-gather + GEMM), the weight gradient from the gathered
    gradient."""

    @staticmethod
    def forward(ctx, x2d, weight, group, allocation_timeout_s):
        ctx.save_for_backward(x2d, weight)
        ctx.group, ctx.allocation_timeout_s = group, allocation_timeout_s
        # the op's output is reused by the call after next
        return _fused_all_reduce(group, allocation_timeout_s).reduce_scatter(x2d, weight.t()).clone()

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        grad_x, gathered = all_gather_matmul(grad.contiguous(), weight, _workspace(ctx.group, ctx.allocation_timeout_s),
                                             return_gathered=True)
        return grad_x, gathered.t() @ x2d, None, None


@lru_cache(maxsize=64)
def check_gradient_gather(rows: int, out_features: int, in_per_rank: int, dtype: torch.dtype) -> None:
    """Raise what the backward of a fused sequence-sharded RowParallelLinear would refuse, in its words: there
    all_gather_matmul reads the output gradient [rows, out_features] and the weight [out_features, in_per_rank]
    through TMA (fp16 / bf16: out_features and in_per_rank multiples of 8). Called in forward, before the
    reduce-scatter starts: a bad shape fails at the first call, not after a forward on every rank. Both operands
    stand in as meta tensors of their layouts (the backward's are contiguous); shapes that pass are remembered."""
    check_weight(torch.empty(out_features, in_per_rank, dtype=dtype, device="meta"), out_features, dtype)
    require_tma_readable(torch.empty(rows, out_features, dtype=dtype, device="meta"),
                         "the output gradient that RowParallelLinear's backward all-gathers")


class _FusedRowParallel(torch.autograd.Function):
    """Forward: x @ W^T and the all-reduce in one launch; backward: the local matmuls (the all-reduce's conjugate
    is the identity)."""

    @staticmethod
    def forward(ctx, x2d, weight, op):
        ctx.save_for_backward(x2d, weight)
        return op(x2d, weight.t()).clone()  # the op's output is reused by the call after next

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x2d, None


class _FusedColumnParallel(torch.autograd.Function):
    """Forward: x @ W^T, local (x is replicated); backward: the input gradient grad @ W and its all-reduce
    (Megatron's "f") in one launch, the weight gradient locally."""

    @staticmethod
    def forward(ctx, x2d, weight, op):
        ctx.save_for_backward(x2d, weight)
        ctx.op = op
        return x2d @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        grad = grad.contiguous()
        return ctx.op(grad, weight).clone(), grad.t() @ x2d, None  # the op's output is reused by the call after next


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts x into for a linear (the dtype F.linear computes in); None where autocast is off
    on x's device, x is no float, or x is float64: autocast casts no float64 operand (a float64 layer computes in
    float64 under it)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(kind)
    return None


def _as_autocast(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype where autocast casts it, so that the collective before the matmul (the bulk
    column-parallel all-gather, and its backward's reduce-scatter or all-reduce) moves those bytes, as the fused
    kernels and Megatron's do, not the fp32 of a norm's output."""
    dtype = _autocast_dtype(x)
    return x if dtype is None else x.to(dtype)


@lru_cache(maxsize=None)
def _workspace(group: dist.ProcessGroup, allocation_timeout_s: float):
    """One symmetric workspace per group (and allocation bound: a run has one), shared by its layers' fused ops:
    the layers run in the same order on every rank, so the ops' per-call epochs agree."""
    return cuda_workspace(group, allocation_timeout_s)


@lru_cache(maxsize=None)
def _fused_all_reduce(group: dist.ProcessGroup, allocation_timeout_s: float) -> GemmAllReduce:
    return GemmAllReduce(_workspace(group, allocation_timeout_s))


def _call_signature(x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """What every rank's call of a layer must share: x's dtype, the weight's, autocast's (`dtype_code`s; 0: off),
    x's dim count, numel and first SIGNATURE_DIMS dims (-1 past its last)."""
    kind = x.device.type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    dims = list(x.shape[:SIGNATURE_DIMS])
    return ([dtype_code(x.dtype), dtype_code(weight.dtype), dtype_code(autocast), x.dim(), x.numel()] + dims
            + [-1] * (SIGNATURE_DIMS - len(dims)))


def _describe_call(signature: list[int]) -> str:
    """`_call_signature` in words: "x [4, 3, 12] float32, weight float32" (", autocast bfloat16" where on)."""
    x_dtype, weight_dtype, autocast = signature[:3]
    ndim = signature[3]
    shape = signature[5:5 + min(ndim, SIGNATURE_DIMS)] + (["..."] if ndim > SIGNATURE_DIMS else [])
    return (f"x [{', '.join(map(str, shape))}] {dtype_name(x_dtype)}, weight {dtype_name(weight_dtype)}"
            + (f", autocast {dtype_name(autocast)}" if autocast else ""))


def full_weight(out_features: int, in_features: int, seed: int, std: float) -> torch.Tensor:
    """The unsharded weight [out, in]: Normal(0, std) from a generator seeded by `seed`, drawn in float64."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((out_features, in_features), generator=generator, dtype=torch.float64) * std


class TPLinear(nn.Module):
    def __init__(self, shard: torch.Tensor, group: dist.ProcessGroup | None, comm: str,
                 allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        """allocation_timeout_s (comm="fused"): how long a rank waits for its peers at an allocation of the group's
        symmetric workspace (dist.symmetric.agree_on_allocation)."""
        super().__init__()
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
        self.group, self.comm, self.allocation_timeout_s = group, comm, allocation_timeout_s
        self.tp_size, self.tp_rank = _size_rank(group)
        self._name = f"shard_{self.tp_rank}_of_{self.tp_size}"
        self.register_parameter(self._name, nn.Parameter(shard.float()))
        self._check_calls = self.tp_size > 1 and dist.get_backend(group) == "gloo"  # see the module docstring

    def _check_same_call(self, x: torch.Tensor) -> None:
        """On gloo: raise on every rank unless every rank calls with x like this rank's (the module docstring)."""
        if self._check_calls:
            check_same_call(_call_signature(x, self.weight), self.group, _describe_call, type(self).__name__)

    def _check_rows(self, x: torch.Tensor) -> None:
        """A sequence-sharded layer gathers or scatters dim 0 of x: a 1-D x (features alone) has none. Checked after
        `_check_same_call` (x's shape alike on every rank): raised on every rank."""
        if x.dim() < 2:
            raise ValueError(f"{type(self).__name__}: a sequence-sharded layer cuts dim 0 of x over the ranks: x "
                             f"{list(x.shape)} has no rows (features alone)")

    @property
    def weight(self) -> nn.Parameter:
        """This rank's shard of the weight."""
        return self._parameters[self._name]

    def _fused_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype the fused kernels compute in (comm=fused, a group of several ranks): CUDA autocast's when that
        is fp16/bf16 (mixed precision: x and the weight are cast, as autocast casts a linear's operands), else x's
        when fp16/bf16; None: the bulk twin (fp32 without autocast, float64 under it too: `_autocast_dtype`; the
        kernels take fp16/bf16). Refuses the CPU."""
        if self.comm != "fused" or self.tp_size == 1:
            return None
        if not x.is_cuda:
            # the config's key too: comm=fused is also the run's other switch (the embeddings', the MoE layers')
            raise RuntimeError("comm=fused (model.tp_comm in the MoE Transformer's config) needs CUDA tensors "
                               "(symmetric memory); use comm=bulk (model.tp_comm=bulk) on the CPU")
        autocast = _autocast_dtype(x)
        if autocast in LOW_PRECISION:
            return autocast  # as F.linear would compute, whatever x's dtype
        return x.dtype if x.dtype in LOW_PRECISION else None


class ColumnParallelLinear(TPLinear):
    """Output features split over the group. `parts` > 1: the output is `parts` equal blocks (e.g. q, k, v) each
    split over ranks, so rank r's output is [block 0 of r, block 1 of r, ...] (attention heads stay whole).
    `seed` a tuple (one per part): each part is drawn as a weight of its own, so that layers fused into one (a
    SwiGLU's w1 and w3) keep the initialisation they had apart.
    `sequence_sharded`: x holds this rank's rows only; they are all-gathered (dim 0 of x) before the matmul."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None,
                 comm: str = "bulk", seed: int | tuple[int, ...] = 0, std: float = 0.02, parts: int = 1,
                 sequence_sharded: bool = False, allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        size, rank = _size_rank(group)
        if out_features % (parts * size):
            raise ValueError(f"out_features={out_features} does not split into {parts} part(s) over {size} ranks")
        per_rank, per_part = out_features // (parts * size), out_features // parts
        if isinstance(seed, tuple):
            if len(seed) != parts:
                raise ValueError(f"{len(seed)} seeds for {parts} part(s): give one per part, or one int")
            full = torch.stack([full_weight(per_part, in_features, s, std) for s in seed])
        else:
            full = full_weight(out_features, in_features, seed, std).view(parts, per_part, in_features)
        super().__init__(full[:, rank * per_rank:(rank + 1) * per_rank].reshape(-1, in_features), group, comm,
                         allocation_timeout_s)
        self.sequence_sharded = sequence_sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight)
        self._check_same_call(x)
        dtype = self._fused_dtype(x)
        if not self.sequence_sharded:
            if dtype is not None:
                y = _FusedColumnParallel.apply(x.reshape(-1, x.shape[-1]).to(dtype), self.weight.to(dtype),
                                               _fused_all_reduce(self.group, self.allocation_timeout_s))
                return y.view(*x.shape[:-1], y.shape[-1])
            return F.linear(_CopyToTP.apply(_as_autocast(x), self.group), self.weight)
        self._check_rows(x)
        if dtype is not None:
            y = _FusedGatherMatmul.apply(x.reshape(-1, x.shape[-1]).to(dtype), self.weight.to(dtype), self.group,
                                         self.allocation_timeout_s)
            return y.view(self.tp_size * x.shape[0], *x.shape[1:-1], y.shape[-1])
        return F.linear(_GatherRows.apply(_as_autocast(x), self.group), self.weight)


class RowParallelLinear(TPLinear):
    """Input features split over the group (x holds this rank's features, e.g. a column-parallel output); the
    output is the all-reduced sum, replicated on every rank, or with `sequence_sharded` this rank's rows of it:
    dim 0 of the output cut into equal parts over the ranks (dim 0 of x a multiple of the group size)."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None,
                 comm: str = "bulk", seed: int = 0, std: float = 0.02, sequence_sharded: bool = False,
                 allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        size, rank = _size_rank(group)
        if in_features % size:
            raise ValueError(f"in_features={in_features} does not split over {size} ranks")
        per_rank = in_features // size
        super().__init__(full_weight(out_features, in_features, seed, std)[:, rank * per_rank:(rank + 1) * per_rank],
                         group, comm, allocation_timeout_s)
        self.sequence_sharded = sequence_sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight)
        self._check_same_call(x)
        if self.sequence_sharded:
            self._check_rows(x)
        if self.sequence_sharded and x.shape[0] % self.tp_size:
            raise ValueError(f"a sequence-sharded output cuts dim 0 of x ({x.shape[0]}) into {self.tp_size} equal "
                             "parts: it must be a multiple of the group size")
        x2d = x.reshape(-1, x.shape[-1])
        dtype = self._fused_dtype(x)
        if self.sequence_sharded:
            if dtype is not None:
                check_gradient_gather(x2d.shape[0] // self.tp_size, *self.weight.shape, dtype)
                y = _FusedRowParallelScatter.apply(x2d.to(dtype), self.weight.to(dtype), self.group,
                                                   self.allocation_timeout_s)
            else:
                y = _ReduceScatterRows.apply(F.linear(x2d, self.weight), self.group)
            return y.view(x.shape[0] // self.tp_size, *x.shape[1:-1], y.shape[-1])
        if dtype is not None:
            y = _FusedRowParallel.apply(x2d.to(dtype), self.weight.to(dtype),
                                        _fused_all_reduce(self.group, self.allocation_timeout_s))
        else:
            y = _ReduceFromTP.apply(F.linear(x2d, self.weight), self.group)
        return y.view(*x.shape[:-1], y.shape[-1])
