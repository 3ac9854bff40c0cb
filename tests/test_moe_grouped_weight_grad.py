"""The experts' weight-gradient kernel against float64: in the interpreter on the CPU (uneven groups, groups without
rows: first, inside, last; a group longer than several K steps; 16-bit rows with fp32 output; no rows at all),
compiled for sm_90 on the CPU (the pipelined loop over loaded bounds), and on a GPU when there is one (every path
of `grouped_weight_grad`: the kernel for fp32 out, torch._grouped_mm for bf16 out). Outputs are poisoned so that
a tile left unwritten shows."""

from __future__ import annotations

import os

import pytest
import torch

from moe.experts import grouped_weight_grad
from moe.kernels.grouped_weight_grad import BLOCK_K, grouped_weight_grad_reference, launch_grouped_weight_grad
from sm90 import compile_for_sm90

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def run(counts, m, n, dtype, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), m, generator=gen).to(dtype)
    g = torch.randn(sum(counts), n, generator=gen).to(dtype)
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.full((len(counts), m, n), float("nan"), dtype=out_dtype)
    launch_grouped_weight_grad(x, g, ends, out_dtype, out=out)
    return out, grouped_weight_grad_reference(x, g, counts)


@interpreter
@pytest.mark.parametrize("counts,m,n", [
    ([5, 0, 3 * BLOCK_K + 7, 1], 40, 136),  # a group without rows inside; one of several K steps and a tail
    ([0, 9, 2, 0], 24, 300),  # first and last without rows; n past one column tile
    ([BLOCK_K], 130, 8),  # m past one row tile; exactly one K step
])
def test_matches_float64(counts, m, n):
    out, want = run(counts, m, n, torch.float32, torch.float32, sum(counts))
    assert not out.isnan().any()
    error = (out.double() - want).norm() / want.norm()
    assert error < 1e-6, error
    for e, rows in enumerate(counts):
        if rows == 0:
            assert torch.equal(out[e], torch.zeros(m, n))


@interpreter
def test_16_bit_rows_give_unrounded_fp32():
    """fp16 rows (the interpreter cannot multiply bf16, see test_moe_fused_layer.py), fp32 out: the sums are kept
    to fp32, finer than a 16-bit result could be."""
    out, want = run([17, 0, 70], 32, 48, torch.float16, torch.float32, 1)
    assert out.dtype == torch.float32
    assert (out.double() - want).norm() / want.norm() < 1e-6
    assert not torch.equal(out.half().float(), out)


@interpreter
def test_no_rows_gives_zeros():
    out, _ = run([0, 0], 16, 16, torch.float32, torch.float32, 2)
    assert torch.equal(out, torch.zeros(2, 16, 16))


def test_cpu_path_is_the_reference_in_the_asked_dtype():
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(9, 8, generator=gen), torch.randn(9, 5, generator=gen)
    got = grouped_weight_grad(x, g, [4, 0, 5], torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), grouped_weight_grad_reference(x, g, [4, 0, 5]))


def test_refuses_mismatched_inputs():
    x, g = torch.randn(6, 8), torch.randn(5, 4)
    with pytest.raises(ValueError, match="the same rows"):
        launch_grouped_weight_grad(x, g, torch.tensor([6], dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="expected contiguous"):
        launch_grouped_weight_grad(x, torch.randn(6, 4), torch.tensor([6], dtype=torch.int32), torch.float32,
                                   out=torch.empty(1, 8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected contiguous"):  # read as [6, 2] rows: a wrong [1, 2, 4]
        launch_grouped_weight_grad(torch.randn(6, 2, 4), torch.randn(6, 4), torch.tensor([6], dtype=torch.int32),
                                   torch.float32)


def test_compiles_for_sm90():
    compile_for_sm90("""
from moe.kernels.grouped_weight_grad import (_grouped_weight_grad_kernel, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS,
                                             NUM_STAGES)
import triton.language as tl
for rows, block_k, precision in (("bf16", BLOCK_K, None), ("fp32", BLOCK_K // 2, "tf32")):
    ptrs = {"x_ptr": "*" + rows, "g_ptr": "*" + rows, "out_ptr": "*fp32", "ends_ptr": "*i32"}
    build(_grouped_weight_grad_kernel, ptrs, dict(M=2048, N=2816, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
          PRECISION=precision, OUT_DTYPE=tl.float32, INTERPRETED=False), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,out_dtype,tol", [(torch.bfloat16, torch.float32, 1e-5),  # the kernel
                                                 (torch.bfloat16, torch.bfloat16, 1e-2),  # torch._grouped_mm
                                                 (torch.float32, torch.float32, 2e-3)])  # the kernel, TF32
def test_on_gpu_matches_float64(dtype, out_dtype, tol):
    counts = [700, 0, 1, 257, 3000, 64, 0, 129]  # skewed, two experts without rows
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts), 256, generator=gen).to("cuda", dtype)
    g = torch.randn(sum(counts), 384, generator=gen).to("cuda", dtype)
    torch.cuda.empty_cache()
    torch.full((len(counts) * 256 * 384 * 4,), float("nan"), device="cuda")  # freed: the output's likely memory
    got = grouped_weight_grad(x, g, counts, out_dtype)
    want = grouped_weight_grad_reference(x, g, counts)
    assert got.dtype == out_dtype and not got.isnan().any()
    assert (got.double() - want).norm() <= tol * want.norm()
    assert not got[1].any() and not got[6].any()
