"""SwiGLU's backward in one pass: da13 = [d gate | d up] from the pre-activations a13 = [gate | up] and dh.

h = silu(gate) * up. With s = sigmoid(gate): d up = dh * gate * s and d gate = dh * up * s * (1 + gate * (1 - s)).
torch's autograd of the same expression runs several elementwise kernels over [rows, ffn] tensors and a cat of the
two halves (elementwise kernels took ~0.8 ms of a fused MoE layer's forward + backward at 49k rows x ffn 1408 on an
H200, 2026-11-23 profile); this kernel reads a13 and dh once and writes da13 once, computing in fp32 and storing
in a13's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_COLS = 128  # of one half: 256 contiguous bytes of a bf16 row per load


@triton.jit(do_not_specialize=["rows"])  # one variant for all row counts (no compile when rows % 16 first is 0)
def _swiglu_backward_kernel(a13_ptr, dh_ptr, da13_ptr, rows, FFN: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_F: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (r < rows)[:, None] & (f < FFN)[None, :]
    row = r.to(tl.int64)[:, None]
    at = row * (2 * FFN) + f[None, :]  # the gate column; the up column is FFN further on
    gate = tl.load(a13_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(a13_ptr + at + FFN, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + row * FFN + f[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    out = da13_ptr.dtype.element_ty
    tl.store(da13_ptr + at, (dh * up * s * (1.0 + gate * (1.0 - s))).to(out), mask=mask)
    tl.store(da13_ptr + at + FFN, (dh * gate * s).to(out), mask=mask)


def swiglu_backward_reference(a13: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """torch autograd of silu(gate) * up (moe.experts.swiglu) in float64."""
    a13 = a13.double().requires_grad_()
    with torch.enable_grad():
        gate, up = a13.chunk(2, dim=-1)
        da13, = torch.autograd.grad(F.silu(gate) * up, a13, dh.double())
    return da13


def swiglu_backward(a13: torch.Tensor, dh: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a13 [rows, 2 ffn], dh [rows, ffn] -> da13 [rows, 2 ffn] in a13's dtype (into `out` if given)."""
    rows, ffn = dh.shape
    if a13.shape != (rows, 2 * ffn):
        raise ValueError(f"a13 {tuple(a13.shape)} does not match dh {tuple(dh.shape)}: expected [{rows}, {2 * ffn}]")
    a13, dh = a13.contiguous(), dh.contiguous()
    if out is None:
        out = torch.empty_like(a13)
    elif out.shape != a13.shape or out.dtype != a13.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(a13.shape)} {a13.dtype} tensor")
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(ffn, BLOCK_COLS))
        _swiglu_backward_kernel[grid](a13, dh, out, rows, FFN=ffn, BLOCK_R=BLOCK_ROWS, BLOCK_F=BLOCK_COLS)
    return out
