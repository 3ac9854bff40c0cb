"""The rotary kernel (interpreter on the CPU) against the torch expression in float64: q-like strided inputs,
positions not a multiple of the block, head dims whose half is not a power of two, three dtypes; its backward
against autograd of the expression; the inverse undoes the rotation."""

from __future__ import annotations

import os

import pytest
import torch

from moe.kernels.rotary import _Rotary, rotary, rotary_reference, rotate
from sm90 import compile_for_sm90

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def qkv_part(batch, heads, seq, dim, dtype, seed):
    """q out of a permuted qkv projection, as CausalSelfAttention makes it: strided, last dim contiguous."""
    qkv = torch.randn(batch, seq, 3, heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return qkv.permute(2, 0, 3, 1, 4)[0]


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
def test_backward_is_autograd_of_the_expression_and_the_inverse_undoes_it(dtype):
    x = qkv_part(2, 2, 21, 12, dtype, seed=3).requires_grad_()
    grad = torch.randn(2, 2, 21, 12, generator=torch.Generator().manual_seed(4)).to(dtype)
    got, = torch.autograd.grad(_Rotary.apply(x, 10000.0), x, grad)
    x64 = x.detach().double().requires_grad_()
    want, = torch.autograd.grad(rotary_reference(x64), x64, grad.double())
    assert relative_error(got, want) < TOL[dtype]
    assert relative_error(rotate(rotate(x.detach()), inverse=True), x.detach().double()) < TOL[dtype]


@interpreter
def test_the_cpu_path_is_the_expression_and_bad_shapes_are_refused():
    x = qkv_part(1, 2, 9, 8, torch.float32, seed=5)
    torch.testing.assert_close(rotary(x), rotary_reference(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="even head_dim"):
        rotate(torch.randn(1, 2, 3, 7))
    assert rotate(torch.randn(1, 2, 0, 8)).shape == (1, 2, 0, 8)  # no positions: nothing to launch


def test_kernel_compiles_for_sm90():
    compile_for_sm90('''
from moe.kernels import rotary
for dtype in ("bf16", "fp16", "fp32"):
    build(rotary._rotary_kernel, {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "log2_base": "fp32",
                                  "sin_sign": "fp32"}, dict(HALF=64, HALF_P2=64, BLOCK_S=16))
''')
