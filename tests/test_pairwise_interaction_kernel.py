"""The pairwise interaction kernels against torch autograd in float64: outputs and both input gradients; uneven F
and D, one feature (no pairs), strided sparse rows, an empty batch, 16-bit inputs; sm_90 compiles. On the CPU in the interpreter;
on a GPU as compiled, with fp32 products in TF32 and without."""

from __future__ import annotations

import os

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from fused_dlrm.kernels.pairwise_interaction import (PairwiseInteraction, kernels_refuse, num_pairs,
                                                     pairwise_interaction, pairwise_interaction_reference)
from sm90 import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernels' tensors (CPU: interpreter)
pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs in the Triton interpreter or on a GPU")


def _inputs(batch: int, features: int, dim: int, seed: int, padded_rows: bool = False):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=gen).to(DEVICE)
    # The fused exchange's sparse input is a view of a larger buffer: rows of F * D values, here with a gap.
    width = features * dim + (8 if padded_rows else 0)
    sparse = torch.randn(batch, width, generator=gen).to(DEVICE)[:, :features * dim].unflatten(1, (features, dim))
    return dense, sparse, gen


SHAPES = [(5, 26, 16, False), (3, 17, 40, True), (2, 1, 24, False), (2, 128, 72, False), (4, 33, 130, True)]


@pytest.mark.parametrize("tf32", [False] + ([True] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("batch,features,dim,padded_rows", SHAPES + ([(300, 128, 256, False)] if DEVICE.type == "cuda"
                                                                     else []))
def test_matches_float64_autograd(batch, features, dim, padded_rows, tf32, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    # fresh data per case, so an output block reused from an earlier case holds wrong values, not right ones
    dense, sparse, gen = _inputs(batch, features, dim, batch * 1000 + features * 10 + dim + tf32, padded_rows)
    assert not kernels_refuse(dense, sparse) and sparse.is_contiguous() != padded_rows
    d, s = dense.requires_grad_(), sparse.requires_grad_()  # (clone would drop the padded rows' strides)
    # The kernels' outputs (allocated with new_empty) start as NaN, so elements a kernel leaves unwritten show
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *size, **kw: new_empty(t, *size, **kw).fill_(float("nan")))
    out = PairwiseInteraction.apply(d, s)
    grad = torch.randn(out.shape, generator=gen).to(DEVICE)
    out.backward(grad)

    d64, s64 = dense.detach().double().requires_grad_(), sparse.detach().double().requires_grad_()
    want = pairwise_interaction_reference(d64, s64)
    want.backward(grad.double())
    assert out.shape == want.shape == (batch, dim + features + num_pairs(features))
    for name, got, ref in (("out", out.detach(), want.detach()), ("dense grad", d.grad, d64.grad),
                           ("sparse grad", s.grad, s64.grad)):
        error = float((got.double() - ref).norm() / ref.norm())  # NaN if any element was left unwritten
        assert error <= (2e-3 if tf32 else 1e-5), f"{name}: relative error {error:.2e}"  # (False for NaN)


# bf16 on GPUs only: Triton 3.6's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("batch,features,dim,padded_rows", [(3, 17, 40, True), (2, 33, 130, False)])
def test_16_bit_inputs_match_float64_autograd(batch, features, dim, padded_rows, dtype):
    """The kernels' 16-bit configuration (products accumulated in fp32, outputs and gradients rounded to the
    inputs' dtype): within two units of the dtype's rounding of float64's."""
    dense, sparse, gen = _inputs(batch, features, dim, batch * 1000 + features * 10 + dim, padded_rows)
    d, s = dense.to(dtype).requires_grad_(), sparse.to(dtype).requires_grad_()
    out = PairwiseInteraction.apply(d, s)
    grad = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    out.backward(grad)
    d64, s64 = d.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    want = pairwise_interaction_reference(d64, s64)
    want.backward(grad.double())
    bound = 2 * torch.finfo(dtype).eps
    for name, got, ref in (("out", out.detach(), want.detach()), ("dense grad", d.grad, d64.grad),
                           ("sparse grad", s.grad, s64.grad)):
        assert got.dtype == dtype
        error = float((got.double() - ref).norm() / ref.norm())
        assert error <= bound, f"{name}: relative error {error:.2e} (bound {bound:.1e})"


def test_reference_is_torchrecs_interaction():
    dense, sparse, _ = _inputs(6, 9, 16, 7)
    dense, sparse = dense.cpu(), sparse.cpu()
    torch.testing.assert_close(pairwise_interaction_reference(dense.double(), sparse.double()),
                               InteractionArch(9)(dense.double(), sparse.double()), rtol=1e-12, atol=1e-12)


def test_empty_batch_and_what_the_kernels_refuse():
    dense, sparse = torch.randn(0, 16, device=DEVICE), torch.randn(0, 5, 16, device=DEVICE)
    d, s = dense.requires_grad_(), sparse.requires_grad_()
    out = PairwiseInteraction.apply(d, s)
    out.sum().backward()
    assert out.shape == (0, 16 + 5 + 10) and d.grad.shape == (0, 16) and s.grad.shape == (0, 5, 16)
    assert "F <= 128" in kernels_refuse(torch.randn(2, 16), torch.randn(2, 129, 16))
    assert "dtypes" in kernels_refuse(torch.randn(2, 16), torch.randn(2, 3, 16, dtype=torch.float64))
    assert "not [B, D] and [B, F, D]" in kernels_refuse(torch.randn(2, 8), torch.randn(2, 3, 16))
    # inputs the kernels refuse take the torch path
    assert pairwise_interaction(torch.randn(2, 16).double(), torch.randn(2, 3, 16).double()).shape == (2, 16 + 3 + 3)


def test_kernels_compile_for_sm90():
    """Every configuration as compiled for the GPU (registers, shared memory, tl.dot's types), at the paper
    config's shape (F = 128, D = 256) and Criteo's (F = 26, D = 16)."""
    compile_for_sm90("""
from fused_dlrm.kernels.pairwise_interaction import (_interaction_forward_kernel, _interaction_backward_kernel,
                                                     CONFIGS, _block_f)
pointers = {"forward": ("dense_ptr", "sparse_ptr", "out_ptr"),
            "backward": ("grad_ptr", "dense_ptr", "sparse_ptr", "grad_dense_ptr", "grad_sparse_ptr")}
kernels = {"forward": _interaction_forward_kernel, "backward": _interaction_backward_kernel}
push_args = ("out_ptrs", "out_row_base_ptr", "out_row_len_ptr", "block_dest_ptr", "block_dst_ptr", "block_stride",
             "block_features_ptr", "divisors_ptr", "ready_ptrs", "ack_ptr", "error_ptr", "rank", "epoch",
             "num_programs", "spin_limit", "scale")
push_types = {"out_ptrs": "*i64", "out_row_base_ptr": "*i64", "out_row_len_ptr": "*i64", "block_dest_ptr": "*i32",
              "block_dst_ptr": "*i32", "block_stride": "i32", "ready_ptrs": "*i64", "ack_ptr": "*i32",
              "error_ptr": "*i32", "scale": "fp32", "batch": "i64"}
row_block_types = {"block_features_ptr": "*i32", "divisors_ptr": "*fp32"}
for (direction, kind), (block_d, num_warps) in CONFIGS.items():
    dtype, precision = ("bf16", "tf32") if kind == "16-bit" else ("fp32", kind)
    for f, d in ((128, 256), (26, 16)):
        shape = dict(F=f, D=d, BLOCK_F=_block_f(f), BLOCK_D=min(block_d, d), PRECISION=precision)
        types = {n: "*" + dtype for n in pointers[direction]}
        if direction == "forward":
            build(kernels[direction], types, shape, num_warps=num_warps, num_stages=1)
            continue
        # one program per sample (the push's arguments None), and pushing into 2 ranks (fp32: the exchange's),
        # without and with row blocks (3 blocks, mean-pooled features divided)
        build(kernels[direction], types, {**shape, **dict.fromkeys(push_args), "PUSH": False, "WORLD": 0,
                                          "ROW_BLOCKS": 1, "DIVIDE": False}, num_warps=num_warps, num_stages=1)
        if dtype == "fp32":
            build(kernels[direction], {**types, **push_types},
                  {**shape, "grad_sparse_ptr": None, "block_features_ptr": None, "divisors_ptr": None, "PUSH": True,
                   "WORLD": 2, "ROW_BLOCKS": 1, "DIVIDE": False}, num_warps=num_warps, num_stages=1)
            build(kernels[direction], {**types, **push_types, **row_block_types},
                  {**shape, "grad_sparse_ptr": None, "PUSH": True, "WORLD": 2, "ROW_BLOCKS": 3, "DIVIDE": True},
                  num_warps=num_warps, num_stages=1)
""")
