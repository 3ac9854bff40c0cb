"""SwiGLU's backward kernel (interpreter on the CPU) against float64 autograd: uneven shapes, no rows, poisoned
output."""

from __future__ import annotations

import os

import pytest
import torch

from moe.kernels.swiglu_backward import swiglu_backward, swiglu_backward_reference
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@pytest.mark.parametrize("rows,ffn,dtype,tol", [(37, 40, torch.float32, 1e-6), (16, 128, torch.float32, 1e-6),
                                                (21, 136, torch.float16, 2e-3)])
def test_matches_float64_autograd(rows, ffn, dtype, tol):
    gen = torch.Generator().manual_seed(rows + ffn)
    a13 = (3 * torch.randn(rows, 2 * ffn, generator=gen)).to(dtype)  # gates well into both tails of the sigmoid
    dh = torch.randn(rows, ffn, generator=gen).to(dtype)
    out = torch.full_like(a13, float("nan"))  # unwritten elements would show
    got = swiglu_backward(a13, dh, out=out)
    want = swiglu_backward_reference(a13, dh)
    assert got is out and got.dtype == dtype and not got.isnan().any()
    assert (got.double() - want).norm() <= tol * want.norm()


def test_no_rows_and_shape_errors():
    assert swiglu_backward(torch.zeros(0, 8), torch.zeros(0, 4)).shape == (0, 8)
    with pytest.raises(ValueError, match="does not match dh"):
        swiglu_backward(torch.zeros(3, 8), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="out must be"):
        swiglu_backward(torch.zeros(3, 8), torch.zeros(3, 4), out=torch.zeros(3, 8, dtype=torch.float16))


def test_kernel_compiles_for_sm90():
    """bf16, as training runs it, which the interpreter cannot compute (triton-lang/triton#11584)."""
    compile_for_sm90("""
from moe.kernels.swiglu_backward import _swiglu_backward_kernel, BLOCK_ROWS, BLOCK_COLS
for dtype in ("bf16", "fp16", "fp32"):
    ptrs = {n: "*" + dtype for n in ("a13_ptr", "dh_ptr", "da13_ptr")}
    build(_swiglu_backward_kernel, ptrs, dict(FFN=1408, BLOCK_R=BLOCK_ROWS, BLOCK_F=BLOCK_COLS))
""")
