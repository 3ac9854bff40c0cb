"""The rotary kernel (interpreter on the CPU) against the torch expression in float64: q-like strided inputs,
positions not a multiple of the block, head dims whose half is not a power of two, three dtypes; q, k and v taken
from the projection in one autograd node, its gradient in the projection's layout against autograd of the split and
the expression; the inverse undoes the rotation."""

from __future__ import annotations

import os

import pytest
import torch

from moe.kernels.rotary import _RotaryQKV, rotary_qkv, rotary_reference, rotate
from sm90 import compile_for_sm90

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def projection(batch, heads, seq, dim, dtype, seed):
    """The attention's qkv projection viewed [B, S, 3, H, head_dim], as CausalSelfAttention passes it."""
    return torch.randn(batch, seq, 3, heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv_part(batch, heads, seq, dim, dtype, seed):
    """q out of the permuted projection: strided, last dim contiguous."""
    return projection(batch, heads, seq, dim, dtype, seed).permute(2, 0, 3, 1, 4)[0]


def relative_error(got, expected):
    return float((got.double() - expected).norm() / expected.norm())


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,seq,dim", [(2, 3, 37, 16), (1, 2, 5, 24), (3, 1, 16, 8)])
def test_forward_matches_the_expression(dtype, batch, heads, seq, dim):
    x = qkv_part(batch, heads, seq, dim, dtype, seed=seq + dim)
    got = rotate(x, base=500.0)  # a small base: angles of the high frequencies wrap many times over 37 positions
    assert got.dtype == dtype and got.is_contiguous() and not got.isnan().any()
    assert relative_error(got, rotary_reference(x.double(), base=500.0)) < TOL[dtype]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_node_and_its_gradient_in_the_projections_layout(dtype):
    qkv = projection(2, 2, 21, 12, dtype, seed=3).requires_grad_()
    grads = [torch.randn(2, 2, 21, 12, generator=torch.Generator().manual_seed(4 + i)).to(dtype) for i in range(3)]
    outs = _RotaryQKV.apply(qkv, 10000.0)
    got, = torch.autograd.grad(outs, qkv, grads)
    qkv64 = qkv.detach().double().requires_grad_()
    q, k, v = qkv64.permute(2, 0, 3, 1, 4)
    want_outs = (rotary_reference(q), rotary_reference(k), v)
    want, = torch.autograd.grad(want_outs, qkv64, [g.double() for g in grads])
    for out, expected in zip(outs, want_outs):
        assert out.is_contiguous() and relative_error(out.detach(), expected.detach()) < TOL[dtype]
    assert got.shape == qkv.shape and relative_error(got, want) < TOL[dtype]
    torch.testing.assert_close(got[:, :, 2], grads[2].transpose(1, 2), rtol=0, atol=0)  # dv: copied as is


@interpreter
def test_the_inverse_undoes_the_rotation_into_a_strided_out():
    x = qkv_part(2, 3, 19, 16, torch.float32, seed=6)
    back = torch.full((2, 19, 3, 3, 16), float("nan")).permute(2, 0, 3, 1, 4)[1]  # k's slot of a projection
    rotate(rotate(x), inverse=True, out=back)
    assert relative_error(back, x.double()) < 1e-5
    with pytest.raises(ValueError, match="out"):
        rotate(x, out=torch.empty(2, 3, 19, 8))


@interpreter
def test_the_cpu_path_is_the_expression_and_bad_shapes_are_refused():
    qkv = projection(1, 2, 9, 8, torch.float32, seed=5)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    for got, want in zip(rotary_qkv(qkv), (rotary_reference(q), rotary_reference(k), v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="even head_dim"):
        rotate(torch.randn(1, 2, 3, 7))
    assert rotate(torch.randn(1, 2, 0, 8)).shape == (1, 2, 0, 8)  # no positions: nothing to launch


def test_kernel_compiles_for_sm90():
    compile_for_sm90('''
from moe.kernels import rotary
for dtype in ("bf16", "fp16", "fp32"):
    build(rotary._rotary_kernel, {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "log2_base": "fp32",
                                  "sin_sign": "fp32"}, dict(HEADS=16, HALF=64, HALF_P2=64, BLOCK_S=16))
''')
