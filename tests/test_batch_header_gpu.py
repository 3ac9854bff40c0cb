"""The input dist's header kernel as compiled, launched through its binary (kernels/launch.py), against its torch
reference on ONE GPU (skipped without one): the interpreter test's cases, and a paper-scale batch (64 keys x 2048
samples, ~1.3M values) with a few out-of-range indices."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.kernels import batch_header as bh
from test_batch_header_kernel import _batch, _header_keys

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("num_keys,world,local_batch,extra,bad,dtype,weights", [
    (7, 2, 300, 0, 9, torch.int64, 1), (13, 4, 57, 5, 3, torch.int32, 0), (13, 3, 57, -4, 2, torch.int64, 3),
    (64, 2, 2048, 0, 0, torch.int64, 0), (64, 2, 2048, 0, 5, torch.int64, -1),
    (128, 2, 2048, 3, 1, torch.int32, 2)])  # weights: the header's code (`dtype_code`)
def test_kernel_equals_reference(num_keys, world, local_batch, extra, bad, dtype, weights):
    seed = num_keys * 100 + world * 10 + bad
    values, counts, rows = (t.cuda() for t in _batch(seed, num_keys, local_batch, extra, bad, dtype))
    header_keys = _header_keys(num_keys, world, seed).cuda()
    want = bh.batch_header_reference(values, counts, rows, header_keys, local_batch, weights)
    for _ in range(3):  # the first call compiles, the others launch the binary
        assert torch.equal(bh.batch_header(values, counts, rows, header_keys, local_batch, weights), want)
