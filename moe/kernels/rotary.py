"""Rotary position embedding (rotate-half form) in one pass, forward and backward.

out = x * cos + rotate_half(x) * sin, per position s and frequency j: angle = s * base^(-2j / head_dim), the
frequencies repeated over the two halves. Written out per half (x = [x1 | x2]):
    out1 = x1 cos - x2 sin,   out2 = x2 cos + x1 sin;
the backward is the inverse rotation (a rotation's transpose): the same with sin's sign flipped.
torch's expression ran ~7 elementwise kernels over q and k per attention layer and as many again in the backward
(slices, negation, cat, two products, the sum, the cos / sin tables: about 2% of a fine-grained MoE Transformer
step at world 1, 2026-11-25); this kernel reads x once and writes out once, computing angles and products in fp32
and storing in x's dtype. `rotary_reference` is the torch expression (the CPU path); `rotary` picks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_POSITIONS = 16


def rotary_reference(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [..., S, head_dim] (positions 0..S-1) as torch ops, cos / sin in x's dtype."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@triton.jit(do_not_specialize=["seq"])
def _rotary_kernel(x_ptr, out_ptr, heads, seq, stride_b, stride_h, stride_s, log2_base, sin_sign,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (b * heads + h, block of positions): rows of x [B, H, S, 2 HALF] (last dim contiguous) rotated
    into out (contiguous); sin_sign = -1 rotates back (the backward)."""
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, HALF_P2)
    mask = (s < seq)[:, None] & (j < HALF)[None, :]
    src = x_ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + s.to(tl.int64)[:, None] * stride_s \
        + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    inv_freq = tl.exp2(-(2.0 * j.to(tl.float32) / (2 * HALF)) * log2_base)
    angle = s.to(tl.float32)[:, None] * inv_freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle) * sin_sign
    dst = out_ptr + (bh.to(tl.int64) * seq + s.to(tl.int64))[:, None] * (2 * HALF) + j[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, base: float = 10000.0, inverse: bool = False) -> torch.Tensor:
    """x [B, H, S, head_dim] (any strides but a contiguous last dim, e.g. q out of a permuted qkv) rotated into a
    new contiguous tensor of x's dtype; inverse=True applies the transpose (the backward)."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotary: expected x [batch, heads, seq, head_dim] of an even head_dim, got "
                         f"{tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, heads, seq, dim = x.shape
    out = torch.empty((batch, heads, seq, dim), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (batch * heads, triton.cdiv(seq, BLOCK_POSITIONS))
        _rotary_kernel[grid](x, out, heads, seq, x.stride(0), x.stride(1), x.stride(2), math.log2(base),
                             -1.0 if inverse else 1.0, HALF=dim // 2, HALF_P2=triton.next_power_of_2(dim // 2),
                             BLOCK_S=BLOCK_POSITIONS, num_warps=4)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base):
        ctx.base = base
        return rotate(x, base)

    @staticmethod
    def backward(ctx, grad):
        return rotate(grad, ctx.base, inverse=True), None


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [B, heads, S, head_dim]: the kernel on CUDA, the torch expression elsewhere."""
    if x.is_cuda:
        return _Rotary.apply(x, base)
    return rotary_reference(x, base)
