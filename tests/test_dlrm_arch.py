"""The project's interaction arch equals torchrec's: same output and same gradients."""

from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from fused_dlrm.models.dlrm import PairwiseInteractionArch


@pytest.mark.parametrize("num_sparse", [0, 1, 5, 26])
def test_pairwise_interaction_equals_torchrec(num_sparse):
    gen = torch.Generator().manual_seed(num_sparse)
    dense = torch.randn(7, 16, generator=gen, dtype=torch.float64)
    sparse = torch.randn(7, num_sparse, 16, generator=gen, dtype=torch.float64)
    grad_out = None
    results = []
    for arch in (InteractionArch(num_sparse), PairwiseInteractionArch(num_sparse)):
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        out = arch(d, s)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(grad_out)
        results.append((out.detach(), d.grad, s.grad))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
