"""The synthetic teacher's bag-hash kernel (interpreter on the CPU) against its torch reference: uneven batch and
feature counts, empty and longest bags, large indices, strided values and lengths; ragged lengths refused; hash bits
equal; compiled for sm_90."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.kernels import bag_hash_means as bhm
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@pytest.mark.parametrize("batch_size,num_features,max_length", [(300, 11, 8), (1, 3, 1), (129, 8, 20), (5, 1, 0)])
def test_kernel_equals_reference(batch_size, num_features, max_length):
    gen = torch.Generator().manual_seed(batch_size * num_features + max_length)
    lengths = torch.randint(0, max_length + 1, (num_features * batch_size,), generator=gen)
    lengths[::7] = 0  # empty bags
    lengths[3::11] = max_length  # the longest bags
    values = torch.randint(0, 2**31 - 1, (int(lengths.sum()),), generator=gen)
    salt = 1_234_567_891
    want = bhm.bag_hash_means_reference(lengths, values, batch_size, salt)
    got = bhm.launch_bag_hash_means(lengths, values, batch_size, salt, max_length)
    assert got.shape == (batch_size,) and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * num_features)


@triton.jit
def _hash_kernel(feature_ptr, value_ptr, out_ptr, salt, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, bhm._row_hash(tl.load(feature_ptr + i), tl.load(value_ptr + i), salt))


def test_row_hash_bits_equal_the_reference():
    gen = torch.Generator().manual_seed(5)
    features = torch.randint(0, 128, (256,), generator=gen)
    values = torch.randint(0, 2**31 - 1, (256,), generator=gen)
    values[:3] = torch.tensor([0, 1, 2**31 - 2])
    out = torch.full((256,), float("nan"))
    _hash_kernel[(1,)](features, values, out, 987_654_321, N=256)
    assert torch.equal(out, bhm.row_hash(features, values, 987_654_321))


def test_kernel_compiles_for_sm90():
    compile_for_sm90("""
from fused_dlrm.kernels import bag_hash_means as bhm
types = {"lengths_ptr": "*i64", "offsets_ptr": "*i64", "values_ptr": "*i64", "partial_ptr": "*fp32"}
build(bhm._bag_hash_means_kernel, types,
      dict(MAX_LENGTH=20, BLOCK=bhm.BLOCK_SAMPLES, FEATURES=bhm.FEATURES_PER_PROGRAM))
""")


def test_int32_indices_hash_as_int64():
    """The hash's products need int64: int32 indices (as a file's KJT may carry) are widened, not overflowed."""
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(0, 5, (4 * 32,), generator=gen)
    values = torch.randint(2**30, 2**31 - 1, (int(lengths.sum()),), generator=gen)
    want = bhm.bag_hash_means(lengths, values, 32, 77, 4)
    torch.testing.assert_close(bhm.bag_hash_means(lengths, values.int(), 32, 77, 4), want, rtol=0, atol=0)


def test_strided_inputs_read_as_their_elements_and_ragged_lengths_refused():
    """A KJT's values (or lengths) may be a strided view: the kernel reads index i at ptr + i, so the launcher
    must hand it contiguous tensors. Lengths that are no whole number of batches are refused, as the reference's
    view refuses them, rather than the last partial feature left out."""
    gen = torch.Generator().manual_seed(13)
    batch_size, num_features, max_length = 37, 10, 6
    lengths = torch.randint(0, max_length + 1, (num_features * batch_size,), generator=gen)
    values = torch.randint(0, 2**31 - 1, (int(lengths.sum()),), generator=gen)
    salt = 4_242
    want = bhm.bag_hash_means_reference(lengths, values, batch_size, salt)
    strided_values = torch.randint(0, 2**31 - 1, (values.numel(), 2), generator=gen)
    strided_values[:, 0] = values
    strided_lengths = torch.randint(0, max_length + 1, (lengths.numel(), 3), generator=gen)
    strided_lengths[:, 1] = lengths
    got = bhm.launch_bag_hash_means(strided_lengths[:, 1], strided_values[:, 0], batch_size, salt, max_length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * num_features)
    with pytest.raises(ValueError, match="batch_size 37"):
        bhm.launch_bag_hash_means(lengths[:-3], values, batch_size, salt, max_length)
