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


@triton.jit
def _interaction_backward_kernel(grad_ptr, dense_ptr, sparse_ptr, grad_dense_ptr, grad_sparse_ptr, grad_stride,
                                 dense_stride, sparse_stride_b, sparse_stride_f, F: tl.constexpr, D: tl.constexpr,
                                 BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    grad_row = grad_ptr + b * grad_stride
    i, j = f[:, None], f[None, :]
    lo, hi = tl.minimum(i, j), tl.maximum(i, j)
    pairs = tl.load(grad_row + D + F + _pair_position(lo, hi, F), mask=(i != j) & (hi < F), other=0.0)  # G
    grad_with_dense = tl.load(grad_row + D + f, mask=f < F, other=0.0).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = (f < F)[:, None] & (d < D)[None, :]
        s = tl.load(sparse_ptr + b * sparse_stride_b + f[:, None] * sparse_stride_f + d[None, :], mask=mask,
                    other=0.0)
        x = tl.load(dense_ptr + b * dense_stride + d, mask=d < D, other=0.0).to(tl.float32)
        grad_s = tl.dot(pairs.to(s.dtype), s, input_precision=PRECISION) + grad_with_dense[:, None] * x[None, :]
        tl.store(grad_sparse_ptr + (b * F + f[:, None]) * D + d[None, :],
                 grad_s.to(grad_sparse_ptr.dtype.element_ty), mask=mask)
        grad_x = tl.load(grad_row + d, mask=d < D, other=0.0).to(tl.float32)
        grad_x += tl.sum(grad_with_dense[:, None] * s.to(tl.float32), axis=0)
        tl.store(grad_dense_ptr + b * D + d, grad_x.to(grad_dense_ptr.dtype.element_ty), mask=d < D)


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


def _launch(direction: str, tensors: tuple[torch.Tensor, ...], strides: tuple[int, ...], batch: int,
            num_features: int, dim: int) -> None:
    kind = _product_kind(tensors[0].dtype)
    block_d, num_warps = CONFIGS[direction, kind]
    block_d = min(block_d, max(16, triton.next_power_of_2(dim)))
    precision = "tf32x3" if kind == "tf32x3" else "tf32"  # (ignored by 16-bit products)
    key = (tuple(t.dtype for t in tensors), tuple(aligned(t) for t in tensors), strides, num_features, dim,
           block_d, num_warps, precision)
    args = (*tensors, *strides, num_features, dim, _block_f(num_features), block_d, precision)
    _LAUNCHES[direction](key, (batch, 1, 1), args, dict(num_warps=num_warps, num_stages=1))


class PairwiseInteraction(torch.autograd.Function):
    """The kernels with autograd: dense [B, D], sparse [B, F, D] (rows contiguous in D) -> [B, D + F + pairs]."""

    @staticmethod
    def forward(ctx, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        b, f, d = sparse.shape
        out = dense.new_empty(b, d + f + num_pairs(f))
        if b:
            _launch("forward", (dense, sparse, out), (dense.stride(0), *sparse.stride()[:2], out.stride(0)), b, f, d)
        ctx.save_for_backward(dense, sparse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dense, sparse = ctx.saved_tensors
        b, f, d = sparse.shape
        grad = grad if grad.stride(1) == 1 else grad.contiguous()
        grad_dense, grad_sparse = dense.new_empty(b, d), sparse.new_empty(b, f, d)
        if b:
            _launch("backward", (grad, dense, sparse, grad_dense, grad_sparse),
                    (grad.stride(0), dense.stride(0), *sparse.stride()[:2]), b, f, d)
        return grad_dense, grad_sparse


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
    elsewhere (and for inputs the kernels do not take: see `kernels_refuse`)."""
    if sparse.is_cuda and not kernels_refuse(dense, sparse):
        return PairwiseInteraction.apply(dense, sparse)
    return pairwise_interaction_reference(dense, sparse)
