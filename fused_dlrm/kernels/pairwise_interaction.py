"""DLRM's pairwise interaction in one kernel per direction: [dense, S dense, the pairs i < j of S S^T] per sample.

For each sample b, with dense row x [D] and sparse rows S [F, D], torchrec's InteractionArch outputs
[x, S x, (S S^T)[i, j] for i < j (row-major)], F(F - 1) / 2 pairs. The backward, from the output's gradient
[g_x, g_w, g_p], is
    d S = G S + g_w x^T   (G: the pairs' gradient placed symmetrically in [F, F], zero diagonal)
    d x = g_x + S^T g_w.
Done with torch ops (as torchrec does, or as batched products, a gather of the pairs and cats) this is a dozen
kernels over [B, F, F] and [B, F, D] tensors: ~2 ms per step of the paper config at a batch of 4096 on one H200
(profile of 2026-11-24, docs/benchmarks.md), against ~0.3 ms of reading S once each way. Here one program per
sample reads S in column blocks: the forward computes S S^T with tl.dot and stores x, S x and the pairs straight
into the output row (no [B, F, F] tensor, no cat); the backward gathers G from the pairs' gradient, and stores
d S and d x in the same pass over S.

With comm=fused, S is (a view of) the fused embedding exchange's output in grad mode, and d S is what that
exchange's backward pushes to the tables' owners: the backward kernel then stores d S there itself (times
torchrec's division by the world size, through peer pointers, raising the push's ready flags: the protocol of
kernels/push_columns.py), instead of writing d S here for the push to read and copy.

fp32 products use TF32 when torch's fp32 matmuls do (torch.backends.cuda.matmul.allow_tf32), as the torch path's
batched products would (relative errors 7.7e-4 against cuBLAS's 2.9e-4 at the paper shape), else three TF32
products each (1.4e-7 to 2e-7, fp32's own error is 2.8e-7). F up to MAX_FEATURES: the [F, F] tile lives in
registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import CompiledLaunches, aligned
from fused_dlrm.kernels.peer_flags import consumer_released, signal_ready
from fused_dlrm.kernels.push_columns import GradientDestinations

MAX_FEATURES = 128


def num_pairs(num_features: int) -> int:
    return num_features * (num_features - 1) // 2


@triton.jit
def _pair_position(i, j, F: tl.constexpr):
    """Row-major position of the pair (i, j), i < j, among the F(F - 1) / 2 pairs."""
    return i * (2 * F - i - 1) // 2 + (j - i - 1)


@triton.jit
def _interaction_forward_kernel(dense_ptr, sparse_ptr, out_ptr, dense_stride, sparse_stride_b, sparse_stride_f,
                                out_stride, F: tl.constexpr, D: tl.constexpr, BLOCK_F: tl.constexpr,
                                BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    out_row = out_ptr + b * out_stride
    sparse_row = sparse_ptr + b * sparse_stride_b
    products = tl.zeros([BLOCK_F, BLOCK_F], tl.float32)
    with_dense = tl.zeros([BLOCK_F], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = (f < F)[:, None] & (d < D)[None, :]
        s = tl.load(sparse_row + f[:, None] * sparse_stride_f + d[None, :], mask=mask, other=0.0)
        x = tl.load(dense_ptr + b * dense_stride + d, mask=d < D, other=0.0)
        tl.store(out_row + d, x, mask=d < D)
        products = tl.dot(s, tl.trans(s), products, input_precision=PRECISION)
        with_dense += tl.sum(s.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_row + D + f, with_dense.to(out_ty), mask=f < F)
    i, j = f[:, None], f[None, :]
    tl.store(out_row + D + F + _pair_position(i, j, F), products.to(out_ty), mask=(i < j) & (j < F))


# One compiled binary serves every step and, in a simulated world, every rank (kernels/launch.py): the ints that
# change between calls of one key are not specialised (Triton would fold a 1 into the binary).
@triton.jit(do_not_specialize=["batch", "epoch", "rank", "num_programs", "spin_limit"])
def _interaction_backward_kernel(grad_ptr, dense_ptr, sparse_ptr, grad_dense_ptr, grad_sparse_ptr, grad_stride,
                                 dense_stride, sparse_stride_b, sparse_stride_f, batch,
                                 out_ptrs, out_row_base_ptr, out_row_len_ptr, block_dest_ptr, block_dst_ptr,
                                 block_stride, block_features_ptr, divisors_ptr,
                                 ready_ptrs, ack_ptr, error_ptr, rank, epoch, num_programs, spin_limit, scale,
                                 F: tl.constexpr, D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                                 PRECISION: tl.constexpr, PUSH: tl.constexpr, WORLD: tl.constexpr,
                                 ROW_BLOCKS: tl.constexpr, DIVIDE: tl.constexpr):
    """One program per sample, d S stored into grad_sparse; or, with PUSH, up to the fused exchange's program count
    (samples pid, pid + grid, ...) storing d S * scale straight into the owners' gradient buffers (the columns
    d0 .. d0 + BLOCK_D of feature f, block k = d0 / BLOCK_D, go to rank block_dest[k, f], from column
    block_dst[k, f] on, row out_row_base[rank] + b) once every owner released that buffer half, then raising
    flags rank * num_programs + slot everywhere, for slots pid, pid + grid, ... below num_programs (the owners
    wait for all of them). With row blocks (ROW_BLOCKS > 1: the exchange's row is wider, GradientDestinations)
    feature f's d S also goes to the wide features block_features[l, f] >= 0 of the block tables (row stride
    block_stride), with DIVIDE divided by divisors[b, f] first."""
    pid = tl.program_id(0)
    f = tl.arange(0, BLOCK_F)
    i, j = f[:, None], f[None, :]
    lo, hi = tl.minimum(i, j), tl.maximum(i, j)
    released = tl.full([], 1, tl.int1)
    if PUSH:  # every owner acknowledged epoch - 1: it no longer reads this half
        for dest in tl.static_range(WORLD):
            released = released & consumer_released(ack_ptr, dest, epoch, spin_limit, error_ptr)
    b = pid.to(tl.int64)
    while b < batch:  # `while`: the interpreter cannot range() over an argument
        grad_row = grad_ptr + b * grad_stride
        pairs = tl.load(grad_row + D + F + _pair_position(lo, hi, F), mask=(i != j) & (hi < F), other=0.0)  # G
        grad_with_dense = tl.load(grad_row + D + f, mask=f < F, other=0.0).to(tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = (f < F)[:, None] & (d < D)[None, :]
            s = tl.load(sparse_ptr + b * sparse_stride_b + f[:, None] * sparse_stride_f + d[None, :], mask=mask,
                        other=0.0)
            x = tl.load(dense_ptr + b * dense_stride + d, mask=d < D, other=0.0).to(tl.float32)
            grad_s = tl.dot(pairs.to(s.dtype), s, input_precision=PRECISION) + grad_with_dense[:, None] * x[None, :]
            if PUSH:
                if DIVIDE:
                    # div_rn: IEEE division, as autograd's through RowBlockSum (`/` is approximate on GPUs)
                    grad_s = tl.div_rn(grad_s, tl.load(divisors_ptr + b * F + f, mask=f < F, other=1.0)[:, None])
                for layer in tl.static_range(ROW_BLOCKS):  # every row block's part receives the sample's d S
                    if layer == 0:
                        wide = f
                    else:
                        wide = tl.load(block_features_ptr + layer * F + f, mask=f < F, other=-1)
                    _store_pushed(grad_s, b, (d0 // BLOCK_D) * block_stride + wide, (f < F) & (wide >= 0), d - d0,
                                  mask & released & (wide >= 0)[:, None], out_ptrs, out_row_base_ptr,
                                  out_row_len_ptr, block_dest_ptr, block_dst_ptr, scale, WORLD)
            else:
                tl.store(grad_sparse_ptr + (b * F + f[:, None]) * D + d[None, :],
                         grad_s.to(grad_sparse_ptr.dtype.element_ty), mask=mask)
            grad_x = tl.load(grad_row + d, mask=d < D, other=0.0).to(tl.float32)
            grad_x += tl.sum(grad_with_dense[:, None] * s.to(tl.float32), axis=0)
            tl.store(grad_dense_ptr + b * D + d, grad_x.to(grad_dense_ptr.dtype.element_ty), mask=d < D)
        b += tl.num_programs(0)
    if PUSH:
        if released:  # no flag over rows not stored (peer_flags: an owner would read an older call's)
            slot = pid
            while slot < num_programs:  # a grid below num_programs (fewer samples) raises the others' flags too
                signal_ready(ready_ptrs, rank * num_programs + slot, epoch, WORLD)
                slot += tl.num_programs(0)


@triton.jit
def _store_pushed(grad_s, b, blocks, rows, offsets, mask, out_ptrs, out_row_base_ptr, out_row_len_ptr,
                  block_dest_ptr, block_dst_ptr, scale, WORLD: tl.constexpr):
    """Store grad_s * scale (fp32) at sample b's row of its owners: each tile row's block of columns (`blocks`: its
    index in the block tables, contiguous over the features) goes to one owner, contiguously and 16-byte aligned
    (`GradientPush.serves` checks), so the address is one per row, its owner's row start chosen by a select over
    the (few) ranks, and the stores stay vectorised along the columns."""
    dest = tl.load(block_dest_ptr + blocks, mask=rows, other=0)
    row_start = tl.zeros(blocks.shape, tl.int64)
    for w in tl.static_range(WORLD):
        row = tl.load(out_row_base_ptr + w) + b
        start = tl.load(out_ptrs + w) + row * tl.load(out_row_len_ptr + w) * 4
        row_start = tl.where(dest == w, start, row_start)
    address = row_start + tl.load(block_dst_ptr + blocks, mask=rows, other=0).to(tl.int64) * 4
    row_ptrs = tl.multiple_of(address.to(tl.pointer_type(tl.float32)), 16)
    tl.store(row_ptrs[:, None] + offsets[None, :], grad_s * scale, mask=mask)


def pairwise_interaction_reference(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[B, D] and [B, F, D] -> [B, D + F + F(F - 1) / 2] with torch ops (autograd gives the backward): the CPU path
    and the kernels' reference."""
    b, f, _ = sparse.shape
    rows, cols = torch.triu_indices(f, f, offset=1, device=sparse.device)
    with_dense = torch.bmm(sparse, dense.unsqueeze(2)).squeeze(2)
    products = torch.bmm(sparse, sparse.transpose(1, 2)).flatten(1)
    return torch.cat((dense, with_dense, products.index_select(1, rows * f + cols)), dim=1)


# (BLOCK_D, num_warps) per direction and kind of product, from a sweep at the paper config's shape (B = 4096,
# F = 128, D = 256) on one H200 (docs/benchmarks.md, 2026-11-24). "tf32x3": fp32 inputs when TF32 is off, three
# TF32 products per product (fp32's accuracy; fp32 FMAs took 1.5-60 ms here). The loops over D are not pipelined
# (num_stages=1): with 2 or 3 stages Triton 3.6 computed some configurations' TF32 products wrong (up to 0.16
# relative), the loaded tile feeding both a tl.dot and a tl.sum, as in triton-lang/triton#6691.
CONFIGS = {("forward", "tf32"): (64, 4), ("backward", "tf32"): (32, 4),
           ("forward", "tf32x3"): (64, 8), ("backward", "tf32x3"): (32, 8),
           ("forward", "16-bit"): (64, 4), ("backward", "16-bit"): (64, 4)}


def _product_kind(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "16-bit"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


def _block_f(num_features: int) -> int:
    return max(16, triton.next_power_of_2(num_features))  # tl.dot's smallest tile side


_LAUNCHES = {"forward": CompiledLaunches(_interaction_forward_kernel),
             "backward": CompiledLaunches(_interaction_backward_kernel)}


def _config(direction: str, dtype: torch.dtype, dim: int) -> tuple[int, int, str]:
    """(BLOCK_D, num_warps, tl.dot's input precision) of a direction at this dtype and D."""
    kind = _product_kind(dtype)
    block_d, num_warps = CONFIGS[direction, kind]
    precision = "tf32x3" if kind == "tf32x3" else "tf32"  # (ignored by 16-bit products)
    return min(block_d, max(16, triton.next_power_of_2(dim))), num_warps, precision


def push_block(dtype: torch.dtype, dim: int) -> int:
    """The columns of a feature's row that the pushing backward stores per block (GradientPush.serves, begin)."""
    return _config("backward", dtype, dim)[0]


def launch_forward(dense: torch.Tensor, sparse: torch.Tensor, out: torch.Tensor) -> None:
    (b, f, d), tensors = sparse.shape, (dense, sparse, out)
    block_d, num_warps, precision = _config("forward", sparse.dtype, d)
    strides = (dense.stride(0), *sparse.stride()[:2], out.stride(0))
    key = (tuple(t.dtype for t in tensors), tuple(aligned(t) for t in tensors), strides, f, d, block_d, num_warps,
           precision)
    args = (*tensors, *strides, f, d, _block_f(f), block_d, precision)
    _LAUNCHES["forward"](key, (b, 1, 1), args, dict(num_warps=num_warps, num_stages=1))


def launch_backward(grad: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor, grad_dense: torch.Tensor,
                     grad_sparse: torch.Tensor | None, push: GradientDestinations | None) -> None:
    """d S into grad_sparse (one program per sample), or pushed to `push`'s owners (its programs, even for an
    empty batch: the owners wait for every program's flag)."""
    (b, f, d), tensors = sparse.shape, (grad, dense, sparse, grad_dense, grad_sparse)
    block_d, num_warps, precision = _config("backward", sparse.dtype, d)
    strides = (grad.stride(0), dense.stride(0), *sparse.stride()[:2])
    world = 0 if push is None else push.out_ptrs.numel()
    row_blocks = 1 if push is None or push.block_features is None else push.block_features.shape[0]
    divide = push is not None and push.divisors is not None
    block_stride = f if push is None else push.block_dest.shape[1]
    key = (tuple(t.dtype for t in tensors if t is not None), tuple(aligned(t) for t in tensors if t is not None),
           strides, f, d, block_d, num_warps, precision, world, block_stride, row_blocks, divide)
    if push is None:
        grid, pushed = b, (None,) * 16
    else:
        grid = _push_grid(b, push.num_programs, sparse.device)
        pushed = (push.out_ptrs, push.out_row_base, push.out_row_len, push.block_dest, push.block_dst, block_stride,
                  push.block_features, push.divisors, push.ready_ptrs, push.ack, push.error, push.rank, push.epoch,
                  push.num_programs, push.spin_limit, push.scale)
    args = (*tensors, *strides, b, *pushed, f, d, _block_f(f), block_d, precision, push is not None, world,
            row_blocks, divide)
    _LAUNCHES["backward"](key, (grid, 1, 1), args, dict(num_warps=num_warps, num_stages=1))


PUSH_PROGRAMS_PER_SM = 4  # a pushing program ends in a release fence over its stores: fewer, longer programs


def _push_grid(batch: int, num_programs: int, device: torch.device) -> int:
    """Programs of a pushing backward: a sample each, up to PUSH_PROGRAMS_PER_SM per SM (each then takes several
    samples before its flags) and the push's flag count; one for an empty batch (the owners wait for its flags)."""
    if device.type == "cuda":
        num_programs = min(num_programs, PUSH_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device)
                           .multi_processor_count)
    return max(1, min(batch, num_programs))


def offered_gradient_push(sparse: torch.Tensor):
    """The gradient push that the autograd node which made `sparse` (through views only) offers, if it serves
    this tensor: the fused embedding exchange's (sparse/fused_all_to_all.py: GradientPush), or the row blocks' sum
    of its output's (sparse/row_wise.py: RowBlockPush), whose gradient the interaction's backward can then store
    into the owners' buffers instead of returning it."""
    node = sparse.grad_fn
    while node is not None and type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    push = getattr(node, "gradient_push", None)
    if push is None or sparse.dtype != torch.float32:  # (the exchange's output is fp32)
        return None
    return push if push.serves(sparse, push_block(sparse.dtype, sparse.shape[2])) else None


class PairwiseInteraction(torch.autograd.Function):
    """The kernels with autograd: dense [B, D], sparse [B, F, D] (rows contiguous in D) -> [B, D + F + pairs].
    With `push` (offered_gradient_push), the backward stores the sparse input's gradient into the owners of the
    embeddings (and returns none for it)."""

    @staticmethod
    def forward(ctx, dense: torch.Tensor, sparse: torch.Tensor, push=None) -> torch.Tensor:
        b, f, d = sparse.shape
        out = dense.new_empty(b, d + f + num_pairs(f))
        if b:
            launch_forward(dense, sparse, out)
        ctx.save_for_backward(dense, sparse)
        ctx.push = push
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dense, sparse = ctx.saved_tensors
        b, f, d = sparse.shape
        grad = grad if grad.stride(1) == 1 else grad.contiguous()
        grad_dense = dense.new_empty(b, d)
        if ctx.push is not None:
            destinations = ctx.push.begin(d, push_block(sparse.dtype, d))
            launch_backward(grad, dense, sparse, grad_dense, None, destinations)
            return grad_dense, None, None
        grad_sparse = sparse.new_empty(b, f, d)
        if b:
            launch_backward(grad, dense, sparse, grad_dense, grad_sparse, None)
        return grad_dense, grad_sparse, None


def kernels_refuse(dense: torch.Tensor, sparse: torch.Tensor) -> str:
    """Why the kernels refuse these inputs, or "" when they take them."""
    if sparse.dim() != 3 or dense.shape != (sparse.shape[0], sparse.shape[2]):
        return f"dense {tuple(dense.shape)} and sparse {tuple(sparse.shape)} are not [B, D] and [B, F, D]"
    if dense.dtype != sparse.dtype or dense.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtypes {dense.dtype} and {sparse.dtype}: the kernels take one of fp32, fp16 and bf16"
    if sparse.shape[1] > MAX_FEATURES:
        return f"{sparse.shape[1]} sparse features: the kernels hold [F, F] in registers, F <= {MAX_FEATURES}"
    if dense.stride(1) != 1 or sparse.stride(2) != 1:
        return "the rows of dense and sparse must be contiguous"
    return ""


def pairwise_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """torchrec InteractionArch's output for dense [B, D] and sparse [B, F, D]: the kernels on GPUs, torch ops
    elsewhere (and for inputs the kernels do not take: see `kernels_refuse`). When sparse is the fused embedding
    exchange's output (a view of it) in grad mode, the backward pushes its gradient to the embeddings' owners
    (also in a simulated world on the CPU, whose exchange runs in the interpreter)."""
    push = offered_gradient_push(sparse) if torch.is_grad_enabled() and sparse.requires_grad else None
    if (sparse.is_cuda or push is not None) and not kernels_refuse(dense, sparse):
        return PairwiseInteraction.apply(dense, sparse, push)
    return pairwise_interaction_reference(dense, sparse)
