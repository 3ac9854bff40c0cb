"""The project's interaction and sparse arches equal torchrec's: same output and same gradients."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedTensor
from torchrec.models.dlrm import InteractionArch, SparseArch

from fused_dlrm.models.dlrm import PairwiseInteractionArch, ViewSparseArch


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


class _Pooled(torch.nn.Module):
    """A stand-in embedding collection: returns `values` as a KeyedTensor under `keys` (any order)."""

    def __init__(self, features: list[str], keys: list[str], dim: int, values: torch.Tensor):
        super().__init__()
        self.configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=10, feature_names=[f])
                        for f in features]
        self.keys, self.dim, self.values = keys, dim, values

    def embedding_bag_configs(self):
        return self.configs

    def forward(self, features):
        return KeyedTensor(self.keys, [self.dim] * len(self.keys), self.values)


@pytest.mark.parametrize("keys", [["a", "b", "c"], ["c", "a", "b"]])  # in the arch's order (a view), or not
def test_view_sparse_arch_equals_torchrec(keys):
    gen = torch.Generator().manual_seed(len(keys))
    values = torch.randn(5, 3 * 4, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    results = []
    for arch in (SparseArch, ViewSparseArch):
        v = values.clone().requires_grad_()
        out = arch(_Pooled(["a", "b", "c"], keys, 4, v))(None)
        out.backward(grad_out)
        results.append((out.detach(), v.grad))
    # the arch of the last iteration (ViewSparseArch) views its input exactly when the keys are in order
    assert (out.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()) == (keys == ["a", "b", "c"])
    for want, got in zip(*results):
        assert torch.equal(got, want)
