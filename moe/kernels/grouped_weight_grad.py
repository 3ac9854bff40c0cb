"""The experts' weight gradients in the parameters' dtype: out[e] = x_e^T @ g_e over each expert's contiguous rows,
accumulated in fp32 and stored as fp32 for fp32 parameters.

Why: under mixed precision the experts compute in bf16 from fp32 weights. torch._grouped_mm stores bf16 only, and
autograd then casts each bf16 weight gradient back to fp32 in a kernel of its own (~8 ms of a fine-grained MoE
Transformer step on one H200, docs/benchmarks.md, M2). Stored in fp32 by the GEMM, the gradient needs no second
pass, and it keeps the bits the bf16 rounding dropped: that step took 5.9 ms less (M4).

One program per (output tile, expert), the expert slowest so that an expert's tiles run together and share its
rows in L2. The K loop runs over the expert's rows, from its start to its end (group ends on the device). Tiles
of 128 x 256 x 64 (8 warps, 3 stages) were the fastest of seven on an H200 at the fine-grained shapes (M3):
within 1.2x of torch._grouped_mm's bf16 output, ~1.3x faster than it with the cast to fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels import TL_DTYPES, dot_precision
from fused_dlrm.kernels.launch import interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64  # BLOCK_K for 16-bit rows; fp32 rows take half (shared memory)
NUM_WARPS, NUM_STAGES = 8, 3


def grouped_weight_grad_reference(x: torch.Tensor, g: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[groups, x cols, g cols] in float64: x_e^T @ g_e per group of rows (zero for a group without rows)."""
    x, g = x.double(), g.double()
    return torch.stack([a.t() @ b for a, b in zip(torch.split(x, counts), torch.split(g, counts))])


@triton.jit
def _rows_product(acc, x_ptr, g_ptr, k, end, m, n, M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """acc + x[k : k + BLOCK_K, m]^T @ g[k : k + BLOCK_K, n], rows at or past `end` read as zeros."""
    rows = (k + tl.arange(0, BLOCK_K)).to(tl.int64)
    keep = rows < end
    a = tl.load(x_ptr + rows[:, None] * M + m[None, :], mask=keep[:, None] & (m[None, :] < M), other=0.0)
    b = tl.load(g_ptr + rows[:, None] * N + n[None, :], mask=keep[:, None] & (n[None, :] < N), other=0.0)
    return tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)


@triton.jit
def _grouped_weight_grad_kernel(x_ptr, g_ptr, out_ptr, ends_ptr, M: tl.constexpr, N: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PRECISION: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    tile, e = tl.program_id(0), tl.program_id(1)
    m = (tile // tl.cdiv(N, BLOCK_N)) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (tile % tl.cdiv(N, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if INTERPRETED:  # the interpreter cannot range() over loaded bounds
        k = start
        while k < end:
            acc = _rows_product(acc, x_ptr, g_ptr, k, end, m, n, M, N, BLOCK_K, PRECISION)
            k += BLOCK_K
    else:  # a for loop, which the compiler software-pipelines
        for k in range(start, end, BLOCK_K):
            acc = _rows_product(acc, x_ptr, g_ptr, k, end, m, n, M, N, BLOCK_K, PRECISION)
    at = e.to(tl.int64) * M * N + m[:, None] * N + n[None, :]
    tl.store(out_ptr + at, acc.to(OUT_DTYPE), mask=(m[:, None] < M) & (n[None, :] < N))


def launch_grouped_weight_grad(x: torch.Tensor, g: torch.Tensor, group_ends: torch.Tensor,
                               out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """[groups, x cols, g cols] of out_dtype: x_e^T @ g_e for the rows group_ends[e - 1] .. group_ends[e] (int32 on
    x's device, groups = its length), accumulated in fp32; into `out` (contiguous) when given. x and g:
    contiguous [rows, cols] of one dtype."""
    if (x.dim() != 2 or g.dim() != 2 or x.dtype != g.dtype or x.shape[0] != g.shape[0]
            or not (x.is_contiguous() and g.is_contiguous())):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and g {tuple(g.shape)} {g.dtype}: expected contiguous "
                         "[rows, cols] of one dtype and the same rows")
    m, n, groups = x.shape[1], g.shape[1], group_ends.numel()
    if out is None:
        out = torch.empty(groups, m, n, dtype=out_dtype, device=x.device)
    elif out.shape != (groups, m, n) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected contiguous {(groups, m, n)} {out_dtype}")
    if groups:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N), groups)
        block_k = BLOCK_K * 2 // x.element_size()  # the same bytes per K step for 16- and 32-bit rows
        _grouped_weight_grad_kernel[grid](x, g, out, group_ends, M=m, N=n, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                          BLOCK_K=block_k, PRECISION=dot_precision(x.dtype, x.device),
                                          OUT_DTYPE=TL_DTYPES[out_dtype], INTERPRETED=interpreting(),
                                          num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
