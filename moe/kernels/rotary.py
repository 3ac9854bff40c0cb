"""Rotary position embedding (rotate-half form) in one pass, forward and backward.

out = x * cos + rotate_half(x) * sin, per position s and frequency j: angle = s * base^(-2j / head_dim), the
frequencies repeated over the two halves. Written out per half (x = [x1 | x2]):
    out1 = x1 cos - x2 sin,   out2 = x2 cos + x1 sin;
the backward is the inverse rotation (a rotation's transpose): the same with sin's sign flipped.
torch's expression ran ~7 elementwise kernels over q and k per attention layer and as many again in the backward
(slices, negation, cat, two products, the sum, the cos / sin tables); this kernel reads x once and writes out
once, computing angles and products in fp32 and storing in x's dtype. At world 1 the fine-grained MoE Transformer's
step fell by 6-7% with it, and by 2% more with the qkv node below and one cos / sin per position for all heads
(docs/benchmarks.md, 2026-11-25). `rotary_reference` is the torch expression (the CPU path); `rotary_qkv` picks, and
takes q, k and v from the attention's projection in one autograd node.
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
def _rotary_kernel(x_ptr, out_ptr, seq, stride_b, stride_h, stride_s, out_b, out_h, out_s, log2_base, sin_sign,
                   HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (block of positions, b): those rows of every head of x [B, HEADS, S, 2 HALF] rotated into out
    (strides given; both last dims contiguous); sin_sign = -1 rotates back (the backward). The angles' cos and sin
    are computed once per program and serve all heads: per element they cost more than its load and store."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    b = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, HALF_P2)
    mask = (s < seq)[:, None] & (j < HALF)[None, :]
    inv_freq = tl.exp2(-(2.0 * j.to(tl.float32) / (2 * HALF)) * log2_base)
    angle = s.to(tl.float32)[:, None] * inv_freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle) * sin_sign
    src = x_ptr + b * stride_b + s.to(tl.int64)[:, None] * stride_s + j[None, :]
    dst = out_ptr + b * out_b + s.to(tl.int64)[:, None] * out_s + j[None, :]
    for h in range(HEADS):
        x1 = tl.load(src + h * stride_h, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * stride_h + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + h * out_h, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + h * out_h + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, base: float = 10000.0, inverse: bool = False, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [B, H, S, head_dim] (any strides but a contiguous last dim, e.g. q out of a permuted qkv) rotated into out
    (default: a new contiguous tensor of x's dtype; a given one may be strided too); inverse=True applies the
    transpose (the backward)."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotary: expected x [batch, heads, seq, head_dim] of an even head_dim, got "
                         f"{tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, heads, seq, dim = x.shape
    if out is None:
        out = torch.empty((batch, heads, seq, dim), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"rotary: out {tuple(out.shape)} with strides {out.stride()} for x {tuple(x.shape)}")
    if out.numel():
        grid = (triton.cdiv(seq, BLOCK_POSITIONS), batch)
        _rotary_kernel[grid](x, out, seq, *x.stride()[:3], *out.stride()[:3], math.log2(base),
                             -1.0 if inverse else 1.0, HEADS=heads, HALF=dim // 2,
                             HALF_P2=triton.next_power_of_2(dim // 2), BLOCK_S=BLOCK_POSITIONS, num_warps=4)
    return out


class _RotaryQKV(torch.autograd.Function):
    """qkv [B, S, 3, H, head_dim] (the attention's projection, viewed) -> rotary(q), rotary(k), v, each
    [B, H, S, head_dim] and contiguous. The backward writes d qkv in qkv's own layout: the gradients of q and k
    rotated back straight into their slots, dv copied into its own; autograd of the split would stack the three
    gradients and then copy the stack into qkv's layout (two passes over 3 x the activations)."""

    @staticmethod
    def forward(ctx, qkv, base):
        ctx.base = base
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return rotate(q, base), rotate(k, base), v.contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grad = torch.empty(dq.shape[0], dq.shape[2], 3, dq.shape[1], dq.shape[3], dtype=dq.dtype, device=dq.device)
        slots = grad.permute(2, 0, 3, 1, 4)
        rotate(dq, ctx.base, inverse=True, out=slots[0])
        rotate(dk, ctx.base, inverse=True, out=slots[1])
        slots[2].copy_(dv)
        return grad, None


def rotary_qkv(qkv: torch.Tensor, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, S, 3, H, head_dim] -> (rotary(q), rotary(k), v) as [B, H, S, head_dim]: the kernel on CUDA, the
    torch expression elsewhere."""
    if qkv.is_cuda:
        return _RotaryQKV.apply(qkv, base)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return rotary_reference(q, base), rotary_reference(k, base), v
